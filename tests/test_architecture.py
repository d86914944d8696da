"""The module layering, read from the code's own imports: every import points down, never up or across a layer.

The layers, top to bottom (README "Layout"). A module may import modules of the layers below its own, and none of
its own layer or above; a new module must be given a layer here. ``gateway.tools`` (the emulator, ``tiergate bench``,
the scripted transport) stands beside the runtime: no runtime module imports it but the command line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GATEWAY = Path(__file__).resolve().parents[1] / "gateway"
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("python -m gateway", ("__main__",)),
    ("the command line", ("cli",)),
    ("composition root", ("app",)),
    ("the rest of the /v1 surface", ("passthrough",)),
    ("HTTP surface", ("api", "server")),
    ("the client side of a request", ("exchange",)),
    ("failover planning", ("failover",)),
    ("deadline routing", ("deadline",)),
    ("routing policy", ("policy",)),
    ("upstream attempts and client", ("upstream",)),
    ("state shared by replicas (Redis) or kept on disk", ("shared", "ledger_file")),
    ("gateway keys: what they may spend, which objects they made", ("keys", "objects")),
    ("upstream health and conversation state", ("health", "conversations")),
    ("the Responses bridge", ("bridge",)),
    ("SSE relay", ("relay",)),
    ("wire shapes and the SSE scanner", ("wire", "sse")),
    ("metrics, live estimates, the request log and traces", ("metrics", "estimates", "logs", "tracing")),
    ("configuration", ("config", "settings")),
    ("the error tree", ("errors",)),
]
# decisions without I/O: routing and failover planning are tested with plain values and a fake clock
PURE = {"policy", "failover", "deadline", "estimates", "keys"}
IO_MODULES = {"asyncio", "aiohttp", "socket", "subprocess", "httpx", "uvicorn", "starlette", "fastapi", "os",
              "prometheus_client", "time"}
RANK = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}
LAYER = {name: layer for layer, names in LAYERS for name in names}


def _module(path: Path) -> str:
    rel = path.relative_to(GATEWAY).with_suffix("")
    return ".".join(rel.parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (at the top or inside a function), as dotted names."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            if node.module == "gateway":  # `from gateway import failover` (not `__version__`: a name, not a module)
                out.update(f"gateway.{alias.name}" for alias in node.names
                           if (GATEWAY / f"{alias.name}.py").exists() or (GATEWAY / alias.name).is_dir())
    return out


def _internal(imported: str) -> str | None:
    """``gateway.x.y`` -> ``x.y`` for modules of the package, else None."""
    if imported == "gateway" or not imported.startswith("gateway."):
        return None
    return imported[len("gateway."):]


RUNTIME = sorted(p for p in GATEWAY.glob("*.py") if p.name != "__init__.py")
TOOLS = sorted((GATEWAY / "tools").glob("*.py"))


def test_every_runtime_module_has_a_layer() -> None:
    missing = [_module(p) for p in RUNTIME if _module(p) not in RANK]
    assert not missing, f"give these modules a layer in tests/test_architecture.py LAYERS: {missing}"


@pytest.mark.parametrize("path", RUNTIME, ids=lambda p: p.stem)
def test_imports_point_down(path: Path) -> None:
    me = _module(path)
    wrong = []
    for imported in sorted(_imports(path)):
        target = _internal(imported)
        if target is None:
            continue
        if target.startswith("tools"):
            if me != "cli":
                wrong.append(f"{imported}: the tools are not on the request path (only the command line runs them)")
            continue
        if target not in RANK:
            wrong.append(f"{imported}: not a module with a layer")
        elif RANK[target] <= RANK[me]:
            where = "across its layer" if RANK[target] == RANK[me] else "upward"
            wrong.append(f"{imported} ({LAYER[target]}) from {me} ({LAYER[me]}): {where}")
    assert not wrong, f"gateway/{path.name} imports against the layering:\n  " + "\n  ".join(wrong)


@pytest.mark.parametrize("name", sorted(PURE))
def test_the_decisions_do_no_io(name: str) -> None:
    used = {m.split(".")[0] for m in _imports(GATEWAY / f"{name}.py")}
    assert not used & IO_MODULES, f"gateway/{name}.py is pure (no I/O) but imports {sorted(used & IO_MODULES)}"


@pytest.mark.parametrize("path", TOOLS, ids=lambda p: p.stem)
def test_tools_do_not_reach_into_the_request_path(path: Path) -> None:
    """The tools may use the runtime's lower layers (a scripted transport speaks the upstream client's contract), never
    the HTTP surface or the composition root."""
    top = {name for name, rank in RANK.items() if rank <= RANK["exchange"]}
    reached = {t for i in _imports(path) if (t := _internal(i)) in top}
    assert not reached, f"gateway/tools/{path.name} imports {sorted(reached)}"


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    """The check itself: an import from a lower layer to a higher one is found (the relay once imported the upstream
    client for StreamInterrupted; it now lives in the error tree)."""
    source = tmp_path / "relay.py"
    source.write_text("from gateway.upstream import UpstreamPool\nimport gateway.errors\n")
    bad = [t for i in _imports(source) if (t := _internal(i)) and RANK[t] <= RANK["relay"]]
    assert bad == ["upstream"]
