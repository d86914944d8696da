"""The real emulator (``gateway.emulator``) with a probe that logs what it did, for ground-truth tests.

``python tests/emulator_probe.py LOG emulate-args...`` runs ``tiergate emulate emulate-args...`` unchanged,
except that every streamed answer appends one JSON line to ``LOG`` when it ends::

    {"rid": X-Client-Request-Id, "received": t, "first_token": t, "last_token": t, "token_chunks": n}

Times are ``time.perf_counter()`` seconds, i.e. ``CLOCK_MONOTONIC`` on Linux, which every process of the
machine shares: they compare directly with the gateway's and the test's own clocks. ``received`` is when the
request was complete (where the emulator starts its TTFT), ``first_token`` / ``last_token`` when the write
holding the first / last token-bearing chunk was handed to the socket. The probe only observes: the
emulator's timers, dialects and bytes are untouched, so this is what the emulator actually did (its
libuv timers have millisecond resolution, so it may differ from what its directive asked by up to ~1 ms).

:func:`start_probed_emulator` starts one on a free port and waits for it, like ``conftest.emulator``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from conftest import Proc

_TOKEN = b'"delta":{"content":"'  # a content delta with text: the role chunk's is '"delta":{"role":...'


class ProbedEmulator(Proc):
    """A probed emulator subprocess: ``port``, ``records`` (the probe's JSON lines), :meth:`record`, :meth:`stop`."""

    def __init__(self, args: list[str], port: int, records: Path, out: Path) -> None:
        self.records = records
        super().__init__(args, port, out, cmd=[sys.executable, str(Path(__file__).resolve()), str(records), *args])

    def record(self, rid: str, timeout: float = 5.0) -> dict[str, Any]:
        """The probe's record of the request whose ``X-Client-Request-Id`` was ``rid``."""
        deadline = time.monotonic() + timeout
        while True:
            if self.records.exists():
                for line in self.records.read_text().splitlines():
                    rec = json.loads(line)
                    if rec["rid"] == rid:
                        return rec
            if time.monotonic() > deadline:
                raise KeyError(f"the emulator logged no request {rid!r}")
            time.sleep(0.01)


def start_probed_emulator(tier: str, tmp: Path, port: int, fixtures: Path) -> ProbedEmulator:
    """Start ``tiergate emulate --tier TIER`` on ``port`` with the probe logging to a file in ``tmp``."""
    args = ["emulate", "--tier", tier, "--port", str(port), "--fixtures", str(fixtures)]
    return ProbedEmulator(args, port, tmp / f"probe-{tier}-{port}.jsonl", tmp / f"probe-{tier}-{port}.log")


def _install(log_path: str) -> None:
    from gateway import emulator

    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - one line per stream, for the process's lifetime
    clock = time.perf_counter
    proto = emulator.EmulatorProtocol
    complete, write_chunk, end_chunked = proto.on_message_complete, proto.write_chunk, proto.end_chunked

    def on_message_complete(self: Any) -> None:
        rid = self.req.headers.get(b"x-client-request-id", b"").decode()
        self.probe = {"rid": rid, "received": clock(), "first_token": None, "last_token": None, "token_chunks": 0}
        complete(self)

    def probed_write(self: Any, payload: bytes) -> None:
        n = payload.count(_TOKEN)
        if n and self.transport is not None:
            now = clock()
            rec = self.probe
            rec["token_chunks"] += n
            rec["first_token"] = rec["first_token"] or now
            rec["last_token"] = now
        write_chunk(self, payload)

    def probed_end(self: Any) -> None:
        end_chunked(self)
        log.write(json.dumps(self.probe) + "\n")

    proto.on_message_complete = on_message_complete
    proto.write_chunk = probed_write
    proto.end_chunked = probed_end


if __name__ == "__main__":
    _install(sys.argv[1])
    from gateway.cli import main

    sys.exit(main(sys.argv[2:]))
