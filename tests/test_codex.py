"""Codex CLI, the coding agent the fast tier is sold for, through the gateway: ``codex exec`` with a custom provider
(``wire_api = "responses"``) on the demo's fast alias, whose upstream serves chat completions only (the Responses
bridge). Codex 0.171 sends its tools in an ``additional_tools`` input item, grouped in ``namespace`` tools, its
``exec`` tool a freeform ``custom`` tool with a Lark grammar, plus ``client_metadata`` and
``include: ["reasoning.encrypted_content"]``: once answered by the standard tier (``x-tiergate-fallback:
responses_feature``), it now runs its tool loop on the fast tier.

The binary comes from npm (``tests/codex``, pinned; ``.ci/run`` installs it). Without it the test is skipped, saying
how to install it; in CI (``CI`` set) it fails instead.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, Stack, sample

CODEX = ROOT / "tests" / "codex" / "node_modules" / ".bin" / "codex"


@pytest.fixture
def codex() -> Path:
    if not CODEX.exists():
        if os.environ.get("CI"):
            pytest.fail("Codex CLI is missing: .ci/run installs it (npm ci --prefix tests/codex)")
        pytest.skip("Codex CLI is not installed: npm ci --prefix tests/codex")
    return CODEX


def test_codex_exec_runs_its_tool_loop_on_the_fast_tier(stack: Stack, codex: Path, tmp_path: Path) -> None:
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(
        'model = "gpt-5.6-sol-fast"\nmodel_provider = "tiergate"\napproval_policy = "never"\n'
        'sandbox_mode = "read-only"\n\n[model_providers.tiergate]\nname = "Tiergate"\n'
        f'base_url = "{stack.base_url}"\nenv_key = "TIERGATE_TEST_KEY"\nwire_api = "responses"\n')
    before = stack.metrics()
    env = {**os.environ, "CODEX_HOME": str(home), "TIERGATE_TEST_KEY": "unused", "NO_COLOR": "1"}
    done = subprocess.run([str(codex), "exec", "--skip-git-repo-check", "Say hi in one word. [[emulate tps=2000 "
                           "ttft_ms=5]]"], cwd=work, env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    after = stack.metrics()

    def grew(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    # a tool call (Codex's freeform exec, bridged as a custom_tool_call), then the answer after its output
    assert grew("tiergate_responses_api_requests_total", tier="fast", mode="bridge") >= 2
    assert grew("tiergate_responses_api_requests_total", tier="standard") == 0
    assert grew("tiergate_fallbacks_total") == 0
