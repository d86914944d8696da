"""The fast tier under contention, FCFS against scheduled (docs/bench.md#contention): a thin wrapper of
``tiergate bench --contention`` (``gateway.tools.loadtest.contention``), so that the harness lists it with the rest.

    .venv/bin/python -m bench.contention [--seconds 60] [--out bench/out/contention]
"""

from __future__ import annotations

import sys

from gateway.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "--contention", *sys.argv[1:]]))
