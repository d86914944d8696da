"""Run the gateway under cProfile with a CPU-time clock: ``python -m bench.gwprofile OUT.prof serve --config ...``.

Unlike ``python -m cProfile`` this (1) times with ``time.process_time``, so the event loop's idle waits do not
count, and (2) starts profiling after the imports, so start-up does not swamp the request path. Time spent
inside uvloop's C code (epoll, socket reads and writes) shows up as ``tottime`` of ``asyncio.runners.run``.
Stop it with SIGINT: uvicorn shuts down, re-raises the signal, and the stats are written here.
"""

from __future__ import annotations

import cProfile
import sys
import time


def main() -> int:
    out, argv = sys.argv[1], sys.argv[2:]
    import uvicorn  # noqa: F401

    import gateway.app  # noqa: F401 - import before profiling starts
    from gateway.cli import main as gateway_main

    prof = cProfile.Profile(time.process_time)
    prof.enable()
    code = 0
    try:
        code = gateway_main(argv)
    except KeyboardInterrupt:
        pass
    finally:
        prof.disable()
        prof.dump_stats(out)
    return code


if __name__ == "__main__":
    sys.exit(main())
