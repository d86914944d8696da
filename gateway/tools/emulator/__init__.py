"""The emulated OpenAI-compatible upstream: one engine for the demo, the tests and the soak (``tiergate emulate``;
docs/emulator.md). It answers **like a model** (each dialect's profile, :data:`PROFILES`; chat, Responses and its
WebSocket mode; tool calls and token limits enough for agents to run; recorded transcripts) or **by script**: a
``handler(Received) -> Plan | None`` (tests: :class:`EmulatorThread`) plays a :class:`Plan` byte for byte.

It is a bare asyncio protocol over httptools' C parser, with loop timers instead of a task per answer, so that it costs
a few microseconds per event and is not the bottleneck of what it serves. The benchmark's own upstream
(``bench/upstream.py``) is kept apart on purpose: the instrument must not change when the gateway's tools do. Its
modules import only those before them, in this order: ``directives``, ``config``, ``plans``, ``schema``, ``counts``,
``profiles``, ``schedule``, ``budget``, ``prompt_cache``, ``surface``, ``shared``, ``generation``, ``responses``,
``faults``, ``websocket``, ``connection``, ``server``.
"""

from __future__ import annotations

from gateway.tools.emulator.config import EmulatorConfig
from gateway.tools.emulator.faults import FAULTS
from gateway.tools.emulator.plans import Handler, Plan, Received
from gateway.tools.emulator.profiles import PROFILES, Profile
from gateway.tools.emulator.schema import schema_instance
from gateway.tools.emulator.server import EmulatorThread, run, serve
from gateway.tools.emulator.shared import Emulator

__all__ = ["FAULTS", "PROFILES", "Emulator", "EmulatorConfig", "EmulatorThread", "Handler", "Plan", "Profile",
           "Received", "run", "schema_instance", "serve"]
