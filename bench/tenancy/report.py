"""What one run found, as ``tenancy.json`` and ``tenancy.md``: per key what was sent, admitted, refused (by status and
error code) and charged against its limits; per trick how often it was tried, how it was answered and whether it
held; the ping floods, the session bursts and the dropped tier in detail; and the gateway's RSS over time."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from bench.tenancy.common import KEY_EXTRA, LIMITS, MAX_STEPS, MAX_USD, Tally
from bench.tenancy.load import TRICKS
from bench.tenancy.phases import BURST

SIDE_TRICKS = {"ping_flood": "hostile", "session_burst": "runs", "pinned_run": "pinned", "tier_drop": "tiered"}


def per_minute(samples: list[dict[str, Any]], name: str) -> float:
    """The most tokens charged to ``name`` within one UTC minute (from the samples)."""
    by_minute: dict[int, list[float]] = defaultdict(list)
    for row in samples:
        by_minute[int(row["t"] // 60)].append(row[f"{name}_tokens"])
    most, before = 0.0, samples[0][f"{name}_tokens"] if samples else 0.0
    for m in sorted(by_minute):
        last = by_minute[m][-1]
        most = max(most, last - before)
        before = last
    return most


def per_key(tally: Tally, samples: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    last = samples[-1]
    out = {}
    for name in LIMITS:
        codes = tally.codes[name]
        admitted = sum(n for label, n in codes.items() if label[:1] in ("1", "2"))
        out[name] = {"limits": {**LIMITS[name], **KEY_EXTRA.get(name, {})}, "sent": tally.sent[name],
                     "admitted": admitted, "refused": dict(sorted((k, n) for k, n in codes.items()
                                                                  if k[:1] not in ("1", "2"))),
                     "tokens_charged": last[f"{name}_tokens"], "usd_charged": last[f"{name}_usd"],
                     "most_tokens_in_one_minute": per_minute(samples, name)}
        out[name]["passed"] = passed(out[name])
    return out


def passed(k: dict[str, Any]) -> list[str]:
    """The limits of key ``k`` its charges passed: the most tokens in one UTC minute over ``tokens_per_minute``, the
    run's USD over ``usd_per_day`` (the run is within one UTC day, or two: it bounds the day's figure from above)."""
    limits, out = k["limits"], []
    if "tokens_per_minute" in limits and k["most_tokens_in_one_minute"] > limits["tokens_per_minute"]:
        out.append("tokens_per_minute")
    if "usd_per_day" in limits and k["usd_charged"] > limits["usd_per_day"]:
        out.append("usd_per_day")
    return out


def verdicts(tally: Tally, extra: dict[str, bool]) -> dict[str, dict[str, Any]]:
    """Per trick: its key, tries, answers (status and code) and ``held`` (no wrong answer, tried at all, and the
    run-end checks in ``extra`` passed)."""
    out = {}
    for trick, key in [*((t, "hostile") for t in TRICKS), *SIDE_TRICKS.items()]:
        wrong = sum(n for what, n in tally.wrong.items() if what.endswith(f":{trick}"))
        tries = tally.tricks[trick]
        held = "not tried" if not tries else "held" if not wrong and extra.get(trick, True) else "NOT HELD"
        out[trick] = {"key": key, "tries": tries, "answers": dict(tally.trick_codes[trick].most_common()),
                      "wrong": wrong, "verdict": held}
    return out


def rss_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    series = [(round(r["t"] - samples[0]["t"]), r["rss_mib"]) for r in samples]
    values = [m for _, m in series]
    return {"start": values[0], "max": max(values), "end": values[-1], "series": series}


def _limits(k: dict[str, Any]) -> str:
    short = {"tokens_per_minute": "tokens/min", "usd_per_day": "USD/day", "requests_per_minute": "requests/min"}
    parts = [f"{v:,} {short.get(n, n)}" for n, v in k.items() if n in short]
    if "tiers" in k:
        parts.append("tiers " + "+".join(k["tiers"]))
    if "session" in k:
        b = k["session"]["budgets"]
        run = f"pinned to {k['session']['id']}" if k["session"].get("id") else "per run"
        parts.append(f"{run}: max_steps {b['max_steps']}, max_usd {b['max_usd']}")
    return "; ".join(parts) or "none"


def markdown(result: dict[str, Any]) -> list[str]:
    md = [f"# Tenancy soak: {result['concurrency']} workers for {result['minutes']:.1f} min, seed {result['seed']}",
          "", "| key | limits | sent | admitted | refused or failed (status code: count) | tokens charged | "
          "most tokens in a UTC minute | USD charged | limits passed |", "|---|---|---:|---:|---|---:|---:|---:|---|"]
    for name, k in result["per_key"].items():
        refused = ", ".join(f"{c}: {n}" for c, n in k["refused"].items()) or "-"
        md.append(f"| {name} | {_limits(k['limits'])} | {k['sent']} | {k['admitted']} | {refused} | "
                  f"{k['tokens_charged']:.0f} | {k['most_tokens_in_one_minute']:.0f} | {k['usd_charged']:.4f} | "
                  f"{', '.join(k['passed']) or 'none'} |")
    md += ["", "| trick | key | tries | answers | verdict |", "|---|---|---:|---|---|"]
    for trick, v in result["tricks"].items():
        answers = ", ".join(f"{c}: {n}" for c, n in v["answers"].items())
        md.append(f"| {trick} | {v['key']} | {v['tries']} | {answers} | {v['verdict']} |")
    md += ["", "by variant: " + "; ".join(f"{k}: {v}" for k, v in sorted(result["variants"].items()))]
    md += _details(result)
    rss = result["rss_mib"]
    md += ["", f"gateway RSS (MiB): start {rss['start']}, max {rss['max']}, end {rss['end']}; over time: "
           + ", ".join(f"{t}s {m}" for t, m in rss["series"]),
           f"breakers opened: {result['breakers_opened']:.0f}; gateway alive at the end: "
           f"{result['gateway_alive_at_end']}", f"wrong answers: {sum(result['wrong'].values())} {result['wrong']}",
           "not tried: " + (", ".join(t for t, v in result["tricks"].items() if v["verdict"] == "not tried")
                            or "none")]
    md += [f"- {k}: {v}" for k, v in result["wrong_examples"].items()]
    return md


def _details(result: dict[str, Any]) -> list[str]:
    md = ["", "ping floods (one socket, 125-byte pings, never read):"]
    md += [f"- {r['ended']} after {r['taken_mib']} MiB ({r['pings']} pings) taken; gateway RSS {r['rss_before_mib']}"
           f" MiB, +{r['rss_grown_mib']} MiB; socket let go {r['released_s']} s after the client closed; "
           f"{'held' if r['held'] else 'NOT HELD'}" for r in result["phases"].get("ping_flood", [])]
    md += ["", f"session bursts ({BURST} steps at once to a fresh run):"]
    for kind in ("steps", "usd"):
        rows = [r for r in result["phases"].get("session_burst", []) + result["phases"].get("pinned_run", [])
                if r["kind"] == kind]
        if rows:
            md.append(f"- {kind}: {len(rows)} bursts ({', '.join(sorted({r['key'] for r in rows}))}), admitted "
                      f"(max_steps {MAX_STEPS}) "
                      f"{sorted({r['admitted'] for r in rows})}, run's USD at most "
                      f"{max(float(r['run_usd'] or 0) for r in rows):.6f} (max_usd {MAX_USD}, bound "
                      f"{rows[0]['bound_usd']}), "
                      f"refusals {_merged(r['refused'] for r in rows)}, next step "
                      f"{sorted({r['next_step'] for r in rows})}, held {sum(r['held'] for r in rows)}/{len(rows)}")
    t = result.get("tier_drop", {})
    if t:
        md += ["", f"dropped tier: {t['requests']} priority asks, {t['dropped_header']} with the dropped header, "
               f"{t['served_priority']} served at priority; charged {t['charged_usd']:.6f} USD, at default prices "
               f"{t['at_default_usd']:.6f}, at priority's {t['at_priority_usd']:.6f}"]
    b = result.get("batches_upstream", {})
    if b:
        md += [f"unreadable batches: the upstream made {b['made']} batches, {b['naming_theirs']} naming another "
               f"key's file; the gateway answered {b['served']} with 200"]
    return md


def _merged(dicts: Any) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for d in dicts:
        for k, n in d.items():
            out[k] += n
    return dict(out)
