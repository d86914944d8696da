"""The Grafana dashboard (``config/grafana/dashboards/tiergate.json``) asks only for metrics the gateway exports.

Every PromQL expression of every panel and template variable is parsed; each metric name it selects must exist
in the gateway's real ``/metrics`` output after traffic (a histogram's ``_bucket``/``_sum``/``_count`` belong to
its family), and each label it matches on must be one that metric carries. The provisioning files and
``docker-compose.yml`` must agree with each other. (``test_prometheus`` also runs every expression in a real
Prometheus, when it is installed.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from conftest import ROOT, Stack, fast_directive

DASHBOARD = ROOT / "config" / "grafana" / "dashboards" / "tiergate.json"
PROVISIONING = ROOT / "config" / "grafana" / "provisioning"

# PromQL words that are not metric names: aggregations, functions, keywords
_KEYWORDS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "histogram_quantile", "rate", "irate", "increase", "delta", "idelta", "deriv", "predict_linear", "resets",
    "changes", "abs", "ceil", "floor", "round", "clamp", "clamp_min", "clamp_max", "label_replace", "label_join",
    "vector", "scalar", "time", "timestamp", "sort", "sort_desc", "absent", "absent_over_time", "sgn", "exp", "ln",
    "log2", "log10", "sqrt", "avg_over_time", "min_over_time", "max_over_time", "sum_over_time", "count_over_time",
    "last_over_time", "quantile_over_time", "present_over_time", "stddev_over_time", "histogram_count",
    "histogram_sum", "histogram_fraction", "inf", "nan", "label_values",
}
_GRAFANA_VARS = re.compile(r"\$\{?__(?:rate_interval|interval|range)\}?")


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets (rows included) and template-variable queries."""
    out: list[str] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            out.extend(t["expr"] for t in panel.get("targets") or [] if t.get("expr"))
            walk(panel.get("panels") or [])

    walk(dashboard["panels"])
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        if var.get("type") == "query" and query:
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
            out.append(m.group(1) if m else query)
    return out


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names matched on) for every vector selector in ``expr``."""
    text = _GRAFANA_VARS.sub("1m", expr).replace("$tier", ".*")
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)  # string literals can hold anything
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery durations
    found: list[tuple[str, set[str]]] = []
    # grouping clauses name labels, not metrics
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*(\{[^}]*\})|([A-Za-z_:][A-Za-z0-9_:]*)", text):
        name = m.group(1) or m.group(3)
        matchers = m.group(2)
        if matchers is None and (name in _KEYWORDS or re.match(r"\s*\(", text[m.end():])):
            continue  # a function or keyword
        if name is None or name in _KEYWORDS:
            raise AssertionError(f"a selector without a metric name in {expr!r}")
        labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers or ""))
        found.append((name, labels))
    return found


def exported(metrics_text: str) -> dict[str, set[str]]:
    """Sample name -> label names seen, including names that a declared family may have but has no sample of."""
    names: dict[str, set[str]] = {}
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
            for suffix in suffixes:
                names.setdefault(family + suffix, set())
        elif line and not line.startswith("#"):
            m = re.match(r"^([^{ ]+)(?:\{(.*)\})? ", line)
            if m:
                names.setdefault(m.group(1), set()).update(re.findall(r'(\w+)="', m.group(2) or ""))
    return names


def test_selector_parser_finds_names_and_labels() -> None:
    expr = ('histogram_quantile(0.95, sum by (tier, le) (rate(tiergate_time_to_first_token_seconds_bucket'
            '{tier=~"$tier", model!="x(y)"}[$__rate_interval]))) / on(tier) group_left up + vector(0)'
            ' and max_over_time(foo:bar[5m:1m])')
    assert dict(selectors(expr)) == {"tiergate_time_to_first_token_seconds_bucket": {"tier", "model"}, "up": set(),
                                     "foo:bar": set()}
    with pytest.raises(AssertionError):
        selectors('{__name__="x"}')  # no metric name to check


def test_every_dashboard_metric_and_label_is_exported(stack: Stack) -> None:
    for model, tier in (("gpt-5.6-sol-fast", "fast"), ("gpt-5.6", "standard")):
        for stream in (True, False):
            resp = httpx.post(stack.base_url + "/chat/completions", timeout=10, json={
                "model": model, "stream": stream,
                "messages": [{"role": "user", "content": fast_directive(tokens=4, tps=2000, ttft_ms=2)}]})
            assert resp.status_code == 200 and resp.headers["x-tiergate-tier"] == tier
    available = exported(stack.metrics())
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard)
    assert len(exprs) >= 15
    used: set[str] = set()
    problems = []
    for expr in exprs:
        sels = selectors(expr)
        if not sels:
            problems.append(f"no metric in {expr!r}")
        for name, labels in sels:
            used.add(name)
            if name not in available:
                problems.append(f"{name} (in {expr!r}) is not in /metrics")
            elif available[name] and not labels <= available[name]:
                problems.append(f"{name} has no label {sorted(labels - available[name])} (in {expr!r})")
    assert not problems, "\n".join(problems)
    # what the dashboard exists to show: TTFT, tokens/s, time per output token and requests per tier
    for name in ("tiergate_time_to_first_token_seconds_bucket", "tiergate_output_tokens_per_second_bucket",
                 "tiergate_time_per_output_token_seconds_bucket", "tiergate_requests_total",
                 "tiergate_fallbacks_total", "tiergate_spillovers_total", "tiergate_in_flight_requests",
                 "tiergate_cost_usd_total"):
        assert name in used, name
    heatmaps = [p for p in dashboard["panels"] if p["type"] == "heatmap"]
    assert any("tiergate_time_per_output_token_seconds_bucket" in t["expr"] for p in heatmaps for t in p["targets"])


def test_a_misspelt_metric_would_be_caught(stack: Stack) -> None:
    available = exported(stack.metrics())
    assert "tiergate_time_to_first_token_seconds_bucket" in available
    for wrong in ("tiergate_ttft_seconds_bucket", "tiergate_time_to_first_token_bucket", "tiergate_cost_total"):
        assert all(name not in available for name, _ in selectors(f"sum(rate({wrong}[5m]))"))


def test_provisioning_and_compose_agree() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    datasources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    uids = {d["uid"] for d in datasources}
    for panel in dashboard["panels"]:
        for ref in [panel.get("datasource"), *(t.get("datasource") for t in panel.get("targets") or [])]:
            assert ref is None or ref["uid"] in uids, (panel["title"], ref)
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "tiergate.yml").read_text())["providers"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in compose["grafana"]["volumes"])
    assert {Path(ROOT / src).resolve() for src in mounts} == {PROVISIONING.resolve(), DASHBOARD.parent.resolve()}
    assert mounts["./config/grafana/dashboards"] == providers[0]["options"]["path"]
    assert mounts["./config/grafana/provisioning"] == "/etc/grafana/provisioning"
    assert any(d["url"] == "http://prometheus:9090" for d in datasources) and "prometheus" in compose
    prom_mount = compose["prometheus"]["volumes"][0].split(":")
    assert (ROOT / prom_mount[0]).resolve() == (ROOT / "config" / "prometheus.yml").resolve()
    scrape = yaml.safe_load((ROOT / "config" / "prometheus.yml").read_text())["scrape_configs"]
    assert scrape[0]["static_configs"][0]["targets"] == ["gateway:8080"]
    assert "--host" in compose["gateway"]["command"] and "0.0.0.0" in compose["gateway"]["command"]


def test_compose_runs_one_image_and_waits_on_health() -> None:
    """Every Tiergate service runs the image `gateway` builds; nothing starts on a sleep; the build context leaves out
    the virtualenv, the git history and the benchmark's output."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    ours = {name: svc for name, svc in compose.items() if "tiergate" in str(svc.get("command", ""))}
    assert set(ours) == {"gateway", "traffic", "gateway-real"}
    assert {svc["image"] for svc in ours.values()} == {"tiergate:local"}
    assert "build" not in compose["traffic"]
    for name in ("traffic", "prometheus"):
        assert compose[name]["depends_on"] == {"gateway": {"condition": "service_healthy"}}
    assert not " ".join(compose["traffic"]["command"]).split("-c ", 1)[1].startswith("sleep")  # no head start
    assert "HEALTHCHECK" in (ROOT / "Dockerfile").read_text()
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "bench/out"} <= set(ignored)


def test_compose_up_needs_no_api_keys() -> None:
    """Compose interpolates every service before it applies profiles: a required ``${VAR:?}`` anywhere in the file
    made a plain ``docker compose up`` (the demo) fail without real keys. The real-upstream service takes its keys
    by name from the shell instead, and ``tiergate serve`` names a missing one itself."""
    text = (ROOT / "docker-compose.yml").read_text()
    values = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"\$\{[^}]*\?", values), "a required variable makes `docker compose up` need it"
    real = yaml.safe_load(text)["services"]["gateway-real"]
    assert real["profiles"] == ["real"]
    assert {"CEREBRAS_API_KEY", "OPENAI_API_KEY"} <= set(real["environment"])  # passed through by name, unset if unset
