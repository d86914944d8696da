"""Codex CLI, the coding agent the fast tier is sold for, through the gateway: ``codex exec`` with a custom provider
(``wire_api = "responses"``) on the fast alias, whose upstream serves chat completions only (the Responses bridge).
Codex 0.171 sends its tools in an ``additional_tools`` input item, grouped in ``namespace`` tools, its ``exec`` tool
a freeform ``custom`` tool with a Lark grammar, plus ``client_metadata`` and
``include: ["reasoning.encrypted_content"]``: once answered by the standard tier (``x-tiergate-fallback:
responses_feature``), it now runs its tool loop on the fast tier.

The fast upstream is an in-test emulator that records what it gets (``EmulatorThread``). Its first answer is a
scripted call of ``exec`` whose freeform input is a line of JavaScript; the bridge answers Codex with it as a
``custom_tool_call``; Codex runs it and sends its output back; the upstream's second request must carry that call and
the output only running that input can give, and Codex must print the answer that follows. A retry, a fallback or a
call Codex could not run (a ``function_call`` for its freeform tool) fails it.

The binary comes from npm (``tests/codex``, pinned; ``.ci/run`` installs it). Without it the test is skipped, saying
how to install it; in CI (``CI`` set) it fails instead.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from gateway.tools.emulator import EmulatorConfig, EmulatorThread, Plan, Received

from conftest import ROOT, Proc, default_config, sample, scraped, sse, start_gateway

CODEX = ROOT / "tests" / "codex" / "node_modules" / ".bin" / "codex"
CALL_ID = "call_codex_loop_1"
# Codex's exec runs the input in a V8 isolate whose text() appends to the tool's output (the tool's description): the
# output, tiergate-42, is not in the script, so only running the input as it was written gives it
SCRIPT = "text('tiergate-' + 6 * 7)"


@pytest.fixture
def codex() -> Path:
    if not CODEX.exists():
        if os.environ.get("CI"):
            pytest.fail("Codex CLI is missing: .ci/run installs it (npm ci --prefix tests/codex)")
        pytest.skip("Codex CLI is not installed: npm ci --prefix tests/codex")
    return CODEX


def _tool_call_first(got: Received) -> Plan | None:
    """The first turn (no tool result yet): one streamed call of ``exec`` with :data:`SCRIPT` as its input, as a
    chat upstream answers the function the bridge offered the freeform tool as; after it, the emulator's own text."""
    if got.path != "/v1/chat/completions" or b'"role":"tool"' in got.body:
        return None
    head = {"id": "chatcmpl-codex", "object": "chat.completion.chunk", "created": 1, "model": "gpt-5.6-wse"}
    call = {"index": 0, "id": CALL_ID, "type": "function",
            "function": {"name": "exec", "arguments": orjson.dumps({"input": SCRIPT}).decode()}}
    chunks = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
              {**head, "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]},
              {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
               "usage": {"prompt_tokens": 900, "completion_tokens": 12, "total_tokens": 912}}]
    return Plan(parts=[(0.0, sse(*(orjson.dumps(c) for c in chunks)))])


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[Proc, EmulatorThread, EmulatorThread]]:
    quick = EmulatorConfig(dialect="cerebras", ttft=0.005, tps=2000.0)
    fast = EmulatorThread(_tool_call_first, config=quick)
    standard = EmulatorThread(config=EmulatorConfig(dialect="openai", ttft=0.005, tps=2000.0))
    proc, _ = start_gateway(default_config(fast.base_url, standard.base_url), tmp_path)
    yield proc, fast, standard
    proc.stop()
    fast.stop()
    standard.stop()


@pytest.mark.parametrize("websocket", [False, True], ids=["http", "websocket"])
def test_codex_exec_runs_its_tool_loop_on_the_fast_tier(gateway: tuple[Proc, EmulatorThread, EmulatorThread],
                                                        codex: Path, tmp_path: Path, websocket: bool) -> None:
    """Over WebSocket mode (``supports_websockets = true``) Codex opens the socket without ``?model=`` and begins
    it with a ``generate: false`` warm-up: answered by the gateway (upstream ``none``), so that every step stays on
    the fast tier instead of following the warm-up to a native upstream."""
    proc, fast, standard = gateway
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(
        'model = "gpt-5.6-sol-fast"\nmodel_provider = "tiergate"\napproval_policy = "never"\n'
        'sandbox_mode = "read-only"\n\n[model_providers.tiergate]\nname = "Tiergate"\n'
        f'base_url = "http://127.0.0.1:{proc.port}/v1"\nenv_key = "TIERGATE_TEST_KEY"\nwire_api = "responses"\n'
        + ("supports_websockets = true\n" if websocket else ""))
    env = {**os.environ, "CODEX_HOME": str(home), "TIERGATE_TEST_KEY": "unused", "NO_COLOR": "1"}
    done = subprocess.run([str(codex), "exec", "--skip-git-repo-check", "Say hi in one word. [[emulate tokens=9]]"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    # what reached the chat upstream: the turn, then the same conversation with the call and what running it gave
    bodies = [orjson.loads(r.body) for r in fast.requests if r.path == "/v1/chat/completions"]
    assert len(bodies) == 2, [b["messages"][-1] for b in bodies]
    first, second = bodies
    assert "exec" in {t["function"]["name"] for t in first["tools"]}
    assert not any(m["role"] in ("assistant", "tool") for m in first["messages"])
    turn, result = second["messages"][-2:]
    assert second["messages"][:-2] == first["messages"]
    # the custom_tool_call Codex sent back, as the bridge offers it to chat: the function taking one string
    assert turn["role"] == "assistant" and [(c["id"], c["function"]["name"], orjson.loads(c["function"]["arguments"]))
                                            for c in turn["tool_calls"]] == [(CALL_ID, "exec", {"input": SCRIPT})]
    assert result["role"] == "tool" and result["tool_call_id"] == CALL_ID
    assert "tiergate-42" in result["content"], result["content"]  # Codex ran the freeform input as its script
    # the answer after the tool's output is what Codex printed
    assert "Every token leaves the gateway" in done.stdout, done.stdout[-2000:]
    assert not standard.requests

    log = [orjson.loads(line) for line in proc.log.read_text().splitlines() if line.startswith("{")]
    steps = [(r["method"], r["tier"], r["upstream"]) for r in log if r.get("event") == "request"]
    if websocket:  # the warm-up, answered by the gateway, then the two steps, all on one socket
        assert steps[0] == ("WS", "fast", "none") and steps[1:] == [("WS", "fast", "emu-fast")] * 2, steps
    else:
        assert steps == [("POST", "fast", "emu-fast")] * 2, steps
    metrics = scraped(proc.port)
    assert sample(metrics, "tiergate_responses_api_requests_total", tier="fast", mode="bridge") == 2
    assert sample(metrics, "tiergate_responses_api_requests_total", tier="standard") == 0
    assert sample(metrics, "tiergate_fallbacks_total") == 0
