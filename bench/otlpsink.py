"""An OTLP/HTTP sink for the benchmark's ``traced`` and ``otelmetrics`` variants: every ``POST`` (``/v1/traces``,
``/v1/metrics``) is read whole and answered ``200`` with an empty protobuf body, which the OpenTelemetry exporters
take as a full success. It keeps nothing; it exists so that the gateway's export costs what it costs against a live
Collector (an exporter that cannot connect retries and logs instead).

    python -m bench.otlpsink --port P
"""

from __future__ import annotations

import argparse
import asyncio

import uvloop

_SEEN: set[bytes] = set()  # the paths posted to: each named once in the log, so a run shows its exports arrived
_OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n"


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            if length:
                await reader.readexactly(length)
            target = head.split(b" ", 2)[1] if head.startswith(b"POST ") else None
            if target is not None and target not in _SEEN:
                _SEEN.add(target)
                print(f"first export to {target.decode('latin-1')} ({length} bytes)", flush=True)
            writer.write(_OK)
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def main(port: int) -> None:
    server = await asyncio.start_server(_serve, "127.0.0.1", port)
    print(f"otlpsink on 127.0.0.1:{port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.otlpsink", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    uvloop.run(main(p.parse_args().port))
