"""The README's test command on a laptop without kubectl or redis-server: the tests that need them are skipped, not
failed; in CI (env ``CI``) the same tests fail, so that a runner missing a tool is never green by skipping. Runs a
few of those tests in a pytest of their own, with a ``PATH`` that has neither tool."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

NEEDING = ["tests/test_kubernetes.py::test_there_are_a_base_a_sidecar_and_replicas",
           "tests/test_kubernetes.py::test_each_kustomization_renders_and_validates",
           "tests/test_payoff.py::test_what_the_fast_tier_saved_is_kept_in_redis_as_in_a_process",
           "tests/test_sessions.py::test_replicas_sharing_redis_keep_a_run_on_one_upstream",
           "tests/test_replicas.py::test_one_replicas_429_puts_the_others_in_cooldown"]


def _pytest(tmp: Path, ci: bool) -> subprocess.CompletedProcess[str]:
    bare = tmp / "bin"  # the shell's own tools only: no kubectl, no redis-server
    bare.mkdir(exist_ok=True)
    for tool in ("sh", "env"):
        for where in ("/usr/bin", "/bin"):
            if (Path(where) / tool).exists() and not (bare / tool).exists():
                (bare / tool).symlink_to(Path(where) / tool)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "COVERAGE_PROCESS_START")}
    env["PATH"] = str(bare)
    if ci:
        env["CI"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-cov", "-n", "0",
                           "--durations=0", "-rs", *NEEDING], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_without_kubectl_and_redis_those_tests_skip_on_a_laptop(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, ci=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert "skipped" in summary and "passed" in summary and "failed" not in summary and "error" not in summary, summary
    assert "kubectl is not installed" in proc.stdout and "redis-server is not installed" in proc.stdout


def test_in_ci_a_missing_tool_fails_instead(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, ci=True)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "kubectl is not installed" in proc.stdout and "redis-server is not installed" in proc.stdout
    assert "skipped" not in proc.stdout.strip().splitlines()[-1]
