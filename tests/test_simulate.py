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
