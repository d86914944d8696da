"""The package layering, read from the code's own imports: every import between packages points down, never up or
across a layer, and no modules import each other round in a circle; and the size of the rooms.

The layers, top to bottom (docs: architecture). A module may import modules of the packages below its own and of its
own package, none of a package beside or above; a new package or top-level module must be given a layer here.
``gateway.tools`` (the emulator, ``tiergate bench``, the scripted transport) stands beside the runtime: no runtime
module imports it but the command line.

The imports are read with ``ast``: at the top of a module, inside a function, and under ``if TYPE_CHECKING:`` alike
(a circle that only a type closes is still two modules that each need the other).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GATEWAY = ROOT / "gateway"
BENCH = ROOT / "bench"
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("python -m gateway", ("__main__",)),
    ("the command line", ("cli",)),
    ("composition root", ("app",)),
    ("HTTP surface: dispatch, authentication, the gateway's own endpoints, the server protocol", ("http",)),
    ("the request pipeline: frame, exchange, planning, attempts, hedging, delivery, conversations, passthrough",
     ("pipeline",)),
    ("admission: the one sequence every entrance goes through (limits, parse, what it is, who may, reservations)",
     ("admission",)),
    ("state shared by replicas (Redis) or kept on disk", ("state",)),
    ("the Responses API: translators and the store", ("responses",)),
    ("upstream attempts, the client, dialects", ("upstream",)),
    ("routing: facts, rules, policy, deadlines, failover planning, health", ("routing",)),
    ("stream: the SSE scanner and the relay", ("stream",)),
    ("wire shapes: request checks, JSON bytes, usage", ("wire",)),
    ("tenancy: gateway keys, what they spend, what they made", ("tenancy",)),
    ("observability: the per-request recorder, metrics, live estimates, logs, traces", ("observability",)),
    ("configuration", ("config",)),
    ("the error tree", ("errors",)),
]
# decisions without I/O: routing and failover planning are tested with plain values and a fake clock
PURE = {"routing/policy.py", "routing/facts.py", "routing/rules.py", "routing/failover.py", "routing/deadline.py",
        "routing/sessions.py", "observability/estimates.py", "tenancy/ledger.py", "tenancy/sessions.py"}
IO_MODULES = {"asyncio", "aiohttp", "socket", "subprocess", "httpx", "uvicorn", "starlette", "fastapi", "os",
              "prometheus_client", "time"}
RANK = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}
LAYER = {name: layer for layer, names in LAYERS for name in names}
MAX_MODULE_LINES = 450  # a room of one idea
MAX_FUNCTION_LINES = 60  # from `def` to its end, docstring included; a table (a dict or list literal) may be longer


def _unit(path: Path) -> str:
    """The package (or top-level module) ``path`` belongs to: ``routing`` for ``gateway/routing/policy.py``."""
    rel = path.relative_to(GATEWAY).with_suffix("")
    return rel.parts[0]


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (at the top, inside a function or for type checking), as dotted names: for
    ``from a.b import c``, ``a.b`` and, when ``c`` is a module of this checkout, ``a.b.c``."""
    tree = ast.parse(path.read_text(), str(path))
    inside = path.is_relative_to(ROOT)
    package = ".".join(path.relative_to(ROOT).parent.parts) if inside else "gateway"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # a relative import: from the package the module is in
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            out.add(base)
            # `from gateway import errors`, `from bench import procs` (not `__version__`: a name, not a module)
            out.update(f"{base}.{alias.name}" for alias in node.names if _module_file(f"{base}.{alias.name}"))
    return out


def _module_file(dotted: str) -> Path | None:
    """The file of the checkout's module (or package face) ``dotted``, or None (a name inside a module, a library)."""
    where = ROOT.joinpath(*dotted.split("."))
    for candidate in (where.with_suffix(".py"), where / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _internal(imported: str) -> str | None:
    """``gateway.x.y`` -> ``x`` (the package or top-level module) for modules of the gateway, else None."""
    if imported == "gateway" or not imported.startswith("gateway."):
        return None
    return imported[len("gateway."):].split(".")[0]


RUNTIME = sorted(p for p in GATEWAY.rglob("*.py") if p.name != "__init__.py" and "tools" not in p.parts)
TOOLS = sorted((GATEWAY / "tools").rglob("*.py"))
# the rooms whose sizes are held to MAX_MODULE_LINES and MAX_FUNCTION_LINES: the runtime and the tools. bench/ is
# exempt, as it is from ruff's complexity ceiling (pyproject.toml): its report builders are flat tables of figures,
# and its load generator keeps its per-stream loop in one frame (its own CPU is part of what a run measures)
SIZED = RUNTIME + TOOLS


def _id(p: Path) -> str:
    return str(p.relative_to(GATEWAY).with_suffix(""))


def test_every_package_has_a_layer() -> None:
    missing = sorted({_unit(p) for p in RUNTIME} - RANK.keys())
    assert not missing, f"give these a layer in tests/test_architecture.py LAYERS: {missing}"


@pytest.mark.parametrize("path", RUNTIME, ids=_id)
def test_imports_point_down(path: Path) -> None:
    me = _unit(path)
    wrong = []
    for imported in sorted(_imports(path)):
        target = _internal(imported)
        if target is None or target == me:
            continue  # outside the gateway, or inside its own package
        if target == "tools":
            if me != "cli":
                wrong.append(f"{imported}: the tools are not on the request path (only the command line runs them)")
            continue
        if target not in RANK:
            wrong.append(f"{imported}: not a package with a layer")
        elif RANK[target] <= RANK[me]:
            where = "across its layer" if RANK[target] == RANK[me] else "upward"
            wrong.append(f"{imported} ({LAYER[target]}) from {me} ({LAYER[me]}): {where}")
    assert not wrong, f"gateway/{_id(path)}.py imports against the layering:\n  " + "\n  ".join(wrong)


@pytest.mark.parametrize("name", sorted(PURE))
def test_the_decisions_do_no_io(name: str) -> None:
    used = {m.split(".")[0] for m in _imports(GATEWAY / name)}
    assert not used & IO_MODULES, f"gateway/{name} is pure (no I/O) but imports {sorted(used & IO_MODULES)}"


@pytest.mark.parametrize("path", TOOLS, ids=_id)
def test_tools_do_not_reach_into_the_request_path(path: Path) -> None:
    """The tools may use the runtime's lower layers (a scripted transport speaks the upstream client's contract), never
    the HTTP surface, the pipeline or the composition root."""
    top = {name for name, rank in RANK.items() if rank <= RANK["pipeline"]}
    reached = {t for i in _imports(path) if (t := _internal(i)) in top}
    assert not reached, f"gateway/{_id(path)}.py imports {sorted(reached)}"


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    """The check itself: an import from a lower layer to a higher one is found (the relay once imported the upstream
    client for StreamInterrupted; it now lives in the error tree)."""
    source = tmp_path / "relay.py"
    source.write_text("from gateway.upstream.client import UpstreamPool\nimport gateway.errors\n")
    bad = [t for i in _imports(source) if (t := _internal(i)) and RANK[t] <= RANK["stream"]]
    assert bad == ["upstream"]


def _module_graph() -> dict[str, set[str]]:
    """The modules of gateway/ (the tools included) and bench/, package faces too, each with the ones it imports:
    paths from the checkout's root. ``import a.b.c`` is an edge to ``a/b/c.py`` alone, not also to the faces of
    ``a`` and ``a.b`` that Python runs first (a face that re-exports its modules would otherwise close a circle
    with each of them)."""
    files = sorted([*GATEWAY.rglob("*.py"), *BENCH.rglob("*.py")])
    graph: dict[str, set[str]] = {}
    for path in files:
        found = (_module_file(name) for name in _imports(path))
        graph[str(path.relative_to(ROOT))] = {str(f.relative_to(ROOT)) for f in found if f and f != path}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one module (Tarjan), each
    sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while (top := stack.pop()) != node:
                component.append(top)
            if component:
                out.append(sorted([node, *component]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(out)


def _ring(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """The shortest way round a circle from its first module, along imports inside it, back to that module."""
    start = members[0]
    came: dict[str, str] = {}
    todo = [start]
    for here in todo:  # breadth first: the list grows as it is read
        for nxt in sorted(graph[here] & set(members)):
            if nxt == start:
                ring = [here]
                while ring[-1] != start:
                    ring.append(came[ring[-1]])
                return [*reversed(ring), start]
            if nxt not in came:
                came[nxt] = here
                todo.append(nxt)
    return members  # pragma: no cover - a circle always leads back


def test_no_modules_import_each_other_round_a_circle() -> None:
    """Imports point one way: what two modules share lives in a lower module both import (the emulator's directives
    and schedule, bench's git revision), not in one of them, imported back lazily."""
    graph = _module_graph()
    assert sum(map(len, graph.values())) > 300 and "bench/report.py" in graph["bench/run.py"]  # the scan reads them
    circles = _cycles(graph)
    assert not circles, "import circles:\n  " + "\n  ".join(
        f"{', '.join(c)} ({' -> '.join(_ring(graph, c))})" for c in circles)


def test_the_circle_rule_catches_a_circle() -> None:
    """The check itself, on the circle the emulator once had: it imported its WebSocket and surface modules, which
    took its generation and schedule back; the prompt cache and the command line were tied to it one way only."""
    graph = {"emulator.py": {"emulator_ws.py", "surface.py", "prompt_cache.py"}, "emulator_ws.py": {"emulator.py"},
             "surface.py": {"emulator.py"}, "prompt_cache.py": set(), "cli.py": {"emulator.py"}}
    assert _cycles(graph) == [["emulator.py", "emulator_ws.py", "surface.py"]]
    assert _ring(graph, ["emulator.py", "emulator_ws.py", "surface.py"]) == ["emulator.py", "emulator_ws.py",
                                                                            "emulator.py"]
    assert _cycles({"a.py": {"b.py"}, "b.py": {"c.py"}, "c.py": set()}) == []


@pytest.mark.parametrize("path", SIZED, ids=_id)
def test_modules_are_rooms_of_one_idea(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"gateway/{_id(path)}.py has {lines} lines: split it by idea"


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function of ``tree`` with its qualified name (``UpstreamPool.send``, ``run.main``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _functions(node, f"{name}.")
        else:
            yield from _functions(node, prefix)


def _long_functions(path: Path) -> dict[str, int]:
    """The functions of ``path`` over :data:`MAX_FUNCTION_LINES`, with their lines (:func:`_long_in`)."""
    return _long_in(ast.parse(path.read_text(), str(path)))


def _long_in(tree: ast.AST) -> dict[str, int]:
    """The functions of ``tree`` over :data:`MAX_FUNCTION_LINES`, with their lines: from ``def`` to the end, the
    docstring included, tables (:func:`_is_table`) left out."""
    out = {}
    for name, node in _functions(tree):
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        tables = sum((s.end_lineno or 0) - s.lineno + 1 for s in node.body if _is_table(s))
        if lines - tables > MAX_FUNCTION_LINES:
            out[name] = lines - tables
    return out


def _is_table(stmt: ast.stmt) -> bool:
    """A statement that only declares a table: an assignment or return of a literal dict, list or tuple."""
    value = stmt.value if isinstance(stmt, ast.Assign | ast.Return | ast.AnnAssign) else None
    return isinstance(value, ast.Dict | ast.List | ast.Tuple)


@pytest.mark.parametrize("path", SIZED, ids=_id)
def test_functions_fit_on_a_screen(path: Path) -> None:
    long = _long_functions(path)
    assert not long, f"gateway/{_id(path)}.py: split these (at most {MAX_FUNCTION_LINES} lines): {long}"


def test_a_function_is_counted_whole() -> None:
    """From ``def`` to its end, its docstring included (issue 32 counts whole functions), a method by its qualified
    name; a table is not counted."""
    doc = "".join(f"        line {i}\n" for i in range(MAX_FUNCTION_LINES - 3))
    table = "".join(f"            'k{i}': {i},\n" for i in range(80))
    source = (f'class Pool:\n    def send(self) -> None:\n        """Send.\n{doc}        """\n        return None\n\n'
              f"    def table(self) -> dict[str, int]:\n        x = 1\n        return {{\n{table}        }}\n")
    assert _long_in(ast.parse(source)) == {"Pool.send": MAX_FUNCTION_LINES + 1}


# The packages that serve a request hand what they learn of it to its recorder (gateway.observability.recorder), the
# only caller of the metrics, the request log and the trace on behalf of a request (docs: architecture).
REQUEST_PATH = ("http", "pipeline", "upstream", "responses", "stream")
_FAMILY_CALLS = frozenset({"labels", "inc", "dec", "observe", "set"})


def _records_itself(path: Path) -> list[str]:
    """Calls in ``path`` that record a request without its recorder: a trace call, a request-log line, an event-log
    line naming a ``request_id``, or a metric family touched directly (``<x>.metrics.<family>.inc()``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        func, owner = node.func, node.func.value
        name = owner.id if isinstance(owner, ast.Name) else None
        if (name == "tracing" or (name == "logs" and func.attr == "request")
                or (name == "logs" and func.attr == "event" and any(k.arg == "request_id" for k in node.keywords))
                or (func.attr in _FAMILY_CALLS and isinstance(owner, ast.Attribute)
                    and isinstance(owner.value, ast.Attribute) and owner.value.attr == "metrics")):
            out.append(f"line {node.lineno}: {ast.unparse(func)}(...)")
    return out


@pytest.mark.parametrize("path", [p for p in RUNTIME if _unit(p) in REQUEST_PATH], ids=_id)
def test_a_request_is_recorded_only_by_its_recorder(path: Path) -> None:
    found = _records_itself(path)
    assert not found, f"gateway/{_id(path)}.py records a request itself; tell its recorder instead: {found}"


def test_the_recorder_rule_catches_a_direct_call(tmp_path: Path) -> None:
    """The check itself, on what the HTTP surface and an attempt once did: a counter bumped, a request-log line, a
    span ended, an event naming a request, all without the request's recorder."""
    source = tmp_path / "dispatch.py"
    source.write_text("self.gateway.metrics.auth_failures.labels(reason).inc()\nlogs.request({})\n"
                      "tracing.end_attempt(span, None)\nlogs.event('x', request_id=rid)\nlogs.event('reloaded')\n")
    assert len(_records_itself(source)) == 4


# What a request is, what routing decided and what was recorded are separate objects, each written by one package
# (docs: architecture): a Request (gateway/admission/request.py) only by admission, a Recorder's fields only by its own
# methods (gateway/observability/). Decisions are frozen dataclasses (gateway/routing/facts.py): nobody writes them.
def _fields(path: Path, cls: str) -> set[str]:
    """The attributes class ``cls`` of ``path`` declares: its annotated fields and its ``__slots__``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            out = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            for s in node.body:
                slots = isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                          for t in s.targets)
                if slots and isinstance(s.value, ast.Tuple):  # type: ignore[union-attr]
                    out |= {e.value for e in s.value.elts if isinstance(e, ast.Constant)}  # type: ignore[union-attr]
            return {f for f in out if not f.startswith("_")}
    raise AssertionError(f"no class {cls} in {path}")


REQUEST_FIELDS = _fields(GATEWAY / "admission/request.py", "Request")
RECORD_FIELDS = (_fields(GATEWAY / "observability/recorder.py", "Recorder")
                 | _fields(GATEWAY / "observability/passthrough.py", "PassRecorder"))


def _writes(path: Path, holder: str, fields: set[str]) -> list[str]:
    """Assignments in ``path`` to a field in ``fields`` of an object reached as ``<x>.<holder>``, or named ``holder``
    (or its short name: ``req`` for ``request``)."""
    names = {holder, {"request": "req"}.get(holder, holder)}
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign | ast.AnnAssign) else []
        flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        for t in flat:
            if not isinstance(t, ast.Attribute) or t.attr not in fields:
                continue
            owner = t.value
            if (isinstance(owner, ast.Attribute) and owner.attr in names) or (
                    isinstance(owner, ast.Name) and owner.id in names):
                out.append(f"line {t.lineno}: {ast.unparse(t)}")
    return out


@pytest.mark.parametrize("path", [p for p in RUNTIME if _unit(p) != "admission"], ids=_id)
def test_only_admission_writes_what_a_request_is(path: Path) -> None:
    found = _writes(path, "request", REQUEST_FIELDS)
    assert not found, f"gateway/{_id(path)}.py writes the request (admission's to write): {found}"


@pytest.mark.parametrize("path", [p for p in RUNTIME if _unit(p) != "observability"], ids=_id)
def test_only_the_recorder_writes_what_was_recorded(path: Path) -> None:
    found = _writes(path, "rec", RECORD_FIELDS)
    assert not found, f"gateway/{_id(path)}.py writes the record; call one of its recorder's methods: {found}"


def test_the_writer_rules_catch_a_write(tmp_path: Path) -> None:
    """The checks themselves, on what the pipeline once did: the model label and the status written from outside."""
    source = tmp_path / "attempts.py"
    source.write_text("ex.rec.tier, ex.rec.upstream = 'fast', 'x'\nreq.stream = True\nex.request.raw += b''\n"
                      "ex.rec.spilled('fast')\n")
    assert len(_writes(source, "rec", RECORD_FIELDS)) == 2
    assert len(_writes(source, "request", REQUEST_FIELDS)) == 2
