"""The emulated OpenAI-compatible upstream: one engine for the demo, the tests and the soak (``tiergate emulate``).

It answers in two ways:

* **like a model** (the default): it streams ``/v1/chat/completions`` with one SSE event per token (or
  ``per_chunk`` tokens per event) at a set rate after a set time to first token, in its dialect's profile
  (:data:`PROFILES`, one row per dialect: ``gateway.tools.emulator.profiles``): OpenAI (role chunk, content chunks,
  finish chunk, a ``choices: []`` usage chunk only with ``stream_options.include_usage``, ``[DONE]``), vLLM (the
  same), Groq (the same, and ``x_groq.usage`` on the finish chunk) or Cerebras (usage and ``time_info`` on the
  finish chunk, no ``[DONE]``);
  answers non-streaming requests after the same simulated generation time (OpenAI: with an ``openai-processing-ms``
  header); serves ``/v1/responses`` the same way (OpenAI only: the gateway bridges the others; a
  ``previous_response_id`` it did not make is a 400 ``previous_response_not_found``, as OpenAI's;
  ``GET`` / ``DELETE /v1/responses/{id}`` read and remove the responses it made; a ``store: false`` response is not
  kept, as OpenAI keeps none: it is a 404 there and a 400 as a ``previous_response_id``; ``GET /v1/responses``
  upgraded to a WebSocket serves its WebSocket mode, where a socket also remembers its own responses, ``store: false``
  included: ``gateway.tools.emulator.websocket``);
  acts enough like a model for agents to run (tool calls, JSON answers, ``n``, token limits:
  ``gateway.tools.emulator.generation``);
  and replays a recorded transcript from ``tests/fixtures/upstream`` at the configured pace;
* **by script**: a ``handler(Received) -> Plan | None`` given in Python (tests: :class:`EmulatorThread`) plays
  a :class:`Plan` byte for byte: status, headers, body parts each written after its delay, then a clean end, a
  close inside the body, a TCP reset, silence, or a connection closed without an answer.

It is a bare asyncio protocol over httptools' C parser, with loop timers instead of a task per answer, so that it
costs a few microseconds per event and is not the bottleneck of what it serves. The benchmark's own upstream
(``bench/upstream.py``) is kept apart on purpose: it stamps every chunk with the clock at the moment of its write,
and the instrument must not change when the gateway's tools do.

How a request is asked to misbehave or to answer otherwise, the ``[[emulate key=value ...]]`` directives in its
body: ``gateway.tools.emulator.directives``; ``POST /emulator/config`` (new defaults mid-run):
:meth:`EmulatorConfig.changed`; the shared token budget (``tokens_per_minute``): ``gateway.tools.emulator.budget``; the
timing log (``timing_log``): ``gateway.tools.emulator.shared``.

Its modules, each importing only those listed before it: ``directives``, ``config``, ``plans`` (a script's
:class:`Plan` and :class:`Received`), ``schema`` (JSON Schema instances), ``counts``, ``profiles`` (the dialects),
``schedule`` (timed writes), ``budget``, ``prompt_cache``, ``surface`` (the rest of ``/v1``), ``shared`` (what an
emulator's connections share), ``generation`` (an answer like a model's), ``responses`` (its Responses API form),
``faults``, ``websocket``, ``connection`` (one HTTP connection), ``server``. This package's face re-exports what
the tests, the benchmark and the command line use.
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
