"""Serving an emulator: on a port until interrupted (``tiergate emulate``: :func:`run`), inside a running loop
(:func:`serve`), or from a background thread on a free loopback port (tests: :class:`EmulatorThread`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from pathlib import Path
from typing import Any

from gateway.tools.emulator.config import EmulatorConfig
from gateway.tools.emulator.connection import EmulatorProtocol
from gateway.tools.emulator.plans import Handler
from gateway.tools.emulator.shared import Emulator


async def serve(config: EmulatorConfig, host: str, port: int, **kw: Any) -> asyncio.Server:
    """``port=0`` picks a free port (see ``server.sockets``); ``kw`` as :class:`Emulator`."""
    loop = asyncio.get_running_loop()
    emulator = Emulator(config, **kw)
    return await loop.create_server(lambda: EmulatorProtocol(emulator), host, port, reuse_address=True,
                                    backlog=2048)


def run(config: EmulatorConfig, host: str, port: int, parent: int | None = None,
        timing_log: Path | None = None) -> None:
    """With ``parent`` (a pid), also until that process is gone (checked every 0.5 s), so that a demo killed with
    SIGKILL leaves no emulator holding its port."""
    async def main() -> None:
        server = await serve(config, host, port, timing_log=timing_log)
        async with server:
            if parent is None:
                await server.serve_forever()
            else:
                while os.getppid() == parent:
                    await asyncio.sleep(0.5)

    with contextlib.suppress(KeyboardInterrupt):
        try:
            import uvloop
        except ImportError:  # pragma: no cover
            asyncio.run(main())
        else:
            uvloop.run(main())


class EmulatorThread(Emulator):
    """For tests: it records every request, ``handler`` may be replaced at any time, ``stop()`` when done."""

    def __init__(self, handler: Handler | None = None, config: EmulatorConfig | None = None) -> None:
        super().__init__(config or EmulatorConfig(), handler, record=True)
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(5):
            raise RuntimeError("the emulator thread did not start")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(self.loop.create_server(lambda: EmulatorProtocol(self), "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()
        server.close()
        self.loop.run_until_complete(server.wait_closed())
        self.loop.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
