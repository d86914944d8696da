"""``tiergate bench --contention`` at tiny sizes (docs/bench.md#contention): both modes in one run, the table's
shape, the scheduler serving the interactive class fast at least as often as first come first served, and no client
seeing a 429."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

from conftest import ROOT


def test_contention_runs_both_modes_and_the_scheduler_keeps_interactive_fast(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "gateway", "bench", "--contention", "--seconds", "4", "--budget",
                           "6000", "--batch", "6", "--agents", "2", "--rate", "4", "--out", str(tmp_path), "--quiet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| interactive | scheduled |" in proc.stdout and "fast budget used" in proc.stdout
    data = orjson.loads((tmp_path / "contention.json").read_bytes())
    rows = {(r["class"], r["mode"]): r for r in data["classes"]}
    assert set(rows) == {(c, m) for c in ("interactive", "agent", "batch") for m in ("FCFS", "scheduled")}
    assert all(r["requests"] > 0 and r["http_429"] == 0 for r in rows.values())
    assert rows["interactive", "scheduled"]["fast"] >= rows["interactive", "FCFS"]["fast"]
    assert rows["interactive", "scheduled"]["deadline_hit"] is not None
    assert [m["mode"] for m in data["modes"]] == ["FCFS", "scheduled"]
    assert all(m["http_429"] == 0 and m["budget_used"] > 0 for m in data["modes"])
    assert (tmp_path / "contention.svg").read_text().startswith("<svg")
    assert (tmp_path / "contention.md").read_text().startswith("| class | mode |")
