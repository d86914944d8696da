"""``bench/simulate.py`` keeps working: a short, seeded (deterministic) run of the three policies over the gateway's
own routing code, in which deadline routing beats static rules on deadline hit rate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_a_short_simulation_compares_the_three_policies(tmp_path: Path) -> None:
    out = tmp_path / "sim.md"
    proc = subprocess.run([sys.executable, "-m", "bench.simulate", "--seconds", "6", "--rate", "400", "--fast-slots",
                           "64", "--fast-rps", "150", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "policy" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["static", "deadline", "deadline+hedge"]
    cells = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in rows}
    hit = {name: float(c[1].rstrip(" %")) for name, c in cells.items()}
    assert hit["deadline"] > hit["static"] + 10  # the fast tier queues up at the peak: deadlines move requests
    assert all(int(c[0].replace(",", "")) > 2000 for c in cells.values())  # ~400 requests/s for 6 s each
    assert cells["static"][-1] == "0 / 0 / 0" and cells["deadline+hedge"][-1] != "0 / 0 / 0"  # only one hedges
    assert proc.stdout.strip() == out.read_text().strip()


def test_a_short_session_simulation_shows_affinity_keeping_prompt_caches_warm(tmp_path: Path) -> None:
    """``bench/simulate_sessions.py``, a few simulated seconds of agent runs: keeping a run on the upstream whose
    prompt cache is warm (``gateway.routing.sessions.affinity`` and ``failover.plan(keep=...)``) raises the cache hit
    rate and lowers the cost against routing each step alone over the same seeded load."""
    out = tmp_path / "sessions.md"
    proc = subprocess.run([sys.executable, "-m", "bench.simulate_sessions", "--seconds", "10", "--rate", "4",
                           "--steps", "10", "--deadline", "35", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    main = out.read_text().split("\n\n")[1]  # the first table (the second counts moves by reason)
    rows = [line for line in main.splitlines() if line.startswith("| ") and "policy" not in line]
    cells = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in rows}
    assert list(cells) == ["no affinity", "affinity", "affinity + cache-aware deadline"]
    runs = {name: c[0] for name, c in cells.items()}
    assert len(set(runs.values())) == 1 and int(runs["affinity"].split()[0]) > 20  # the same load for each
    cost = {name: float(c[2]) for name, c in cells.items()}
    hit = {name: float(c[3].rstrip(" %")) for name, c in cells.items()}
    moves = {name: float(c[6]) for name, c in cells.items()}
    for kept in ("affinity", "affinity + cache-aware deadline"):
        assert hit[kept] > hit["no affinity"] + 5  # weights no longer move consecutive steps off a warm cache
        assert cost[kept] < 0.95 * cost["no affinity"]  # cached prompt tokens at a tenth of the input price
        assert moves[kept] < moves["no affinity"]
    assert proc.stdout.strip() == out.read_text().strip()
