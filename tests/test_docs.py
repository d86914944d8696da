"""The documentation: the README stays one screen that opens with the two set-up commands, and the docs site
(``mkdocs.yml``, ``docs/``) builds with ``--strict`` (a broken link or anchor fails it), its generated reference
naming every metric family the gateway registers and every setting and config field there is.

The generated tables come from ``docs/hooks.py``; its ``_sources()`` is the one place that imports the gateway for
them, and these tests read the gateway through it too.
"""

from __future__ import annotations

import ast
import html
import importlib.util
import inspect
import logging
import os
import re
import subprocess
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from conftest import ROOT

README = ROOT / "README.md"
SET_UP = [  # the two commands that do all set-up on a fresh machine: the demo, then the tests
    "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/tiergate demo",
    "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/pytest",
]
MAX_README_WORDS = 600


def _hooks() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("tiergate_docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hooks() -> types.ModuleType:
    return _hooks()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built as CI builds it: ``mkdocs build --strict`` (any warning, a broken link or anchor included,
    fails the build)."""
    out = tmp_path_factory.mktemp("site")
    env = {k: v for k, v in os.environ.items() if "MKDOCS_2_WARNING" not in k}  # as a reader's shell has it
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert "WARNING" not in done.stderr and "warning" not in done.stderr.lower(), done.stderr  # nor a banner
    return out


def _page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text(encoding="utf-8")


# --- the README ----------------------------------------------------------------------------------------------------

def test_the_readme_is_one_screen() -> None:
    words = len(README.read_text(encoding="utf-8").split())
    assert words <= MAX_README_WORDS, f"README.md has {words} words; the rest belongs in docs/"


def test_the_readme_opens_with_the_two_set_up_commands() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    fence = next(i for i, line in enumerate(lines) if line.startswith("```"))
    before = [line for line in lines[:fence] if line.strip()]
    assert before[0] == "# Tiergate"
    assert len(before) <= 2, f"only a title and one line may come before the commands: {before}"
    block = lines[fence + 1:lines.index("```", fence + 1)]
    assert block == SET_UP


def test_the_readmes_links_reach_files_and_anchors_that_exist(site: Path) -> None:
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README.md links to {link}, which does not exist"
        if anchor:
            assert path.startswith("docs/") and path.endswith(".md"), link
            page = _page(site, path.removeprefix("docs/").removesuffix(".md"))
            assert f'id="{anchor}"' in page, f"README.md links to {link}: no such anchor on the page"


def test_every_docs_page_and_anchor_the_code_cites_exists(site: Path) -> None:
    """The code's comments and docstrings cite the docs as ``docs/PAGE.md#anchor`` (the wire reference included):
    each must be a page of the site with that heading, so a renamed heading cannot leave a citation dangling."""
    cited = 0
    for source in sorted([*(ROOT / "gateway").rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "bench").glob(
            "*.py")]):
        for path, anchor in re.findall(r"docs/([a-z0-9_/-]+)\.md(?:#([a-z0-9_-]+))?", source.read_text("utf-8")):
            cited += 1
            assert (ROOT / "docs" / f"{path}.md").exists(), f"{source.name} cites docs/{path}.md, which does not exist"
            if anchor:
                assert f'id="{anchor}"' in _page(site, path), f"{source.name} cites docs/{path}.md#{anchor}: no anchor"
    assert cited > 20  # the code does cite the docs: the pattern matches


def test_the_config_the_demo_reads_is_config_demo_yaml() -> None:
    """The docs tell readers to change ``config/demo.yaml``; ``tiergate demo`` reads the packaged
    ``gateway/demo.yaml`` (a symlink to it in the repository; a copy in a wheel): they must be the same file."""
    from gateway.cli import DEMO_CONFIG

    assert DEMO_CONFIG == ROOT / "gateway" / "demo.yaml"
    assert DEMO_CONFIG.read_bytes() == (ROOT / "config" / "demo.yaml").read_bytes()


# --- the generated reference ---------------------------------------------------------------------------------------

def test_every_metric_family_the_gateway_registers_is_on_the_metrics_page(site: Path, hooks: Any) -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    hooks._sources().metrics(registry, models=("gpt-5.6",), routes=(("fast", "f", ("gpt-5.6",)),))
    families = list(registry.collect())
    assert len(families) > 30
    page = _page(site, "metrics")
    for family in families:
        exported = family.name + "_total" if family.type == "counter" else family.name
        assert f"<code>{exported}</code>" in page, f"{exported} is not on the metrics page"
        assert html.escape(family.documentation, quote=False) in page, f"{exported}: its help text is not there"


def _config_paths(model: type[BaseModel], prefix: str = "", above: tuple[type[BaseModel], ...] = ()) -> Iterator[str]:
    """Every field of the config file by its dotted path: ``upstreams[].timeouts.connect``, ``aliases.<name>.tier``; a
    section that holds its own kind again (prices per service tier are prices) is walked once."""
    for name, field in model.model_fields.items():
        path = prefix + name
        yield path
        nested = _nested(field.annotation)
        if nested is not None and nested[0] is not model and nested[0] not in above:
            yield from _config_paths(nested[0], path + nested[1] + ".", (*above, model))


def _nested(annotation: Any, step: str = "") -> tuple[type[BaseModel], str] | None:
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation, step
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list:
        return _nested(args[0], step + "[]")
    if origin is dict:
        return _nested(args[1], step + ".<name>")
    for arg in args:  # X | None
        found = _nested(arg, step)
        if found is not None:
            return found
    return None


def test_every_config_field_and_setting_is_on_the_configuration_page(site: Path, hooks: Any) -> None:
    page = _page(site, "configuration")
    paths = list(_config_paths(hooks._sources().config))
    assert {"upstreams", "upstreams[].timeouts.ttft", "upstreams[].model_prices.<name>.input",
            "auth.keys[].fast.usd_per_day", "rules[].match.headers.<name>.regex"} <= set(paths)
    for path in paths:
        assert f"<code>{html.escape(path, quote=False)}</code>" in page, f"config field {path} is not documented"
    settings = hooks._sources().settings
    for name, field in settings.model_fields.items():
        variable = field.validation_alias if isinstance(field.validation_alias, str) else f"GATEWAY_{name.upper()}"
        assert f"<code>{variable}</code>" in page, f"setting {variable} is not documented"
    assert f"<code>{hooks._sources().redis_url_var}</code>" in page


def test_every_error_class_is_on_the_errors_page(site: Path, hooks: Any) -> None:
    page = _page(site, "errors")
    pending = list(hooks._sources().error.__subclasses__())
    while pending:
        cls = pending.pop()
        pending += cls.__subclasses__()
        if not issubclass(cls, hooks._sources().startup_error):
            assert f"<code>{cls.__name__}</code>" in page, f"{cls.__name__} is not on the errors page"


CODE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+")  # an OpenAI error code: snake_case, at least two words


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and CODE.fullmatch(n.value)}


def error_codes() -> set[str]:
    """Every error ``code`` the gateway's own source can answer with (``gateway/``, not the emulator's ``tools/``):
    a class's ``code`` attribute, a ``code=`` argument (its literals: ``err.code or "capacity_exceeded"`` counts),
    the ``"code"`` of a dict literal (an in-band error event), the default of a ``code`` parameter, and a literal
    passed where a function (or a class's ``__init__``) of the gateway takes ``code`` positionally
    (``StreamInterrupted``)."""
    sources = sorted(p for p in (ROOT / "gateway").rglob("*.py") if "tools" not in p.parts)
    trees = [ast.parse(p.read_text("utf-8")) for p in sources]
    where: dict[str, set[int]] = {}  # callable name -> positions of its code parameter (without self)
    for tree in trees:
        for node in ast.walk(tree):
            defs = [(node.name, node)] if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else []
            if isinstance(node, ast.ClassDef):
                defs = [(node.name, f) for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
            for name, fn in defs:
                params = [a.arg for a in fn.args.posonlyargs + fn.args.args if a.arg not in ("self", "cls")]
                if "code" in params:
                    where.setdefault(name, set()).add(params.index("code"))
    return {code for tree in trees for node in ast.walk(tree) for code in _codes_at(node, where)}


def _codes_at(node: ast.AST, where: dict[str, set[int]]) -> set[str]:
    """The codes ``node`` itself produces (:func:`error_codes`)."""
    if isinstance(node, ast.ClassDef):
        return {c for st in node.body if isinstance(st, ast.Assign | ast.AnnAssign) and st.value is not None
                and any(isinstance(t, ast.Name) and t.id == "code"
                        for t in (st.targets if isinstance(st, ast.Assign) else [st.target]))
                for c in _strings(st.value)}
    if isinstance(node, ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        return ({c for kw in node.keywords if kw.arg == "code" for c in _strings(kw.value)}
                | {c for i in where.get(name, ()) if i < len(node.args) for c in _strings(node.args[i])})
    if isinstance(node, ast.Dict):
        return {c for k, v in zip(node.keys, node.values, strict=True)
                if isinstance(k, ast.Constant) and k.value == "code" for c in _strings(v)}
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        a = node.args
        positional = a.posonlyargs + a.args
        pairs = [*zip(positional[len(positional) - len(a.defaults):], a.defaults, strict=True),
                 *zip(a.kwonlyargs, a.kw_defaults, strict=True)]
        return {c for arg, d in pairs if arg.arg == "code" and d is not None for c in _strings(d)}
    return set()


def test_every_error_code_the_gateway_answers_is_on_the_errors_page(hooks: Any) -> None:
    """docs/errors.md claims every error: each ``code`` the source can produce is named on it (in its text, or in
    the error-class table generated into it)."""
    codes = error_codes()
    assert {"model_not_found", "session_budget_exceeded", "too_many_requests_in_flight", "upstream_idle_timeout",
            "websocket_connection_limit_reached", "capacity_exceeded"} <= codes  # the collector finds each form
    text = (ROOT / "docs" / "errors.md").read_text("utf-8") + hooks._error_classes()
    missing = sorted(code for code in codes if f"`{code}`" not in text)
    assert not missing, f"error codes the gateway answers with that docs/errors.md does not name: {missing}"


def test_every_response_header_the_gateway_sets_is_in_the_routing_table() -> None:
    """Each ``x-tiergate-*`` response header (the gateway writes its response headers as bytes: ``b"x-tiergate-..."``)
    is a row of the table on docs/routing.md#response-headers."""
    names = {name for p in (ROOT / "gateway").rglob("*.py") if "tools" not in p.parts
             for name in re.findall(r'b"(x-tiergate-[a-z0-9-]+)"', p.read_text("utf-8"))}
    assert {"x-tiergate-tier", "x-tiergate-session-budget", "x-tiergate-predicted-ms"} <= names
    page = (ROOT / "docs" / "routing.md").read_text("utf-8")
    section = page.split("{ #response-headers }", 1)[1].split("\n## ", 1)[0]
    rows = {name for line in section.splitlines() if line.startswith("| `")  # a row's header, or its companions
            for name in re.findall(r"`(x-tiergate-[a-z0-9-]+)`", line)}  # ("with `x-tiergate-predicted-ms` / ...")
    missing = sorted(names - rows)
    assert not missing, f"response headers missing from the table of docs/routing.md#response-headers: {missing}"


def test_every_config_section_opens_with_its_own_words(hooks: Any) -> None:
    """A section's text on the configuration page is its class's docstring: one that sends the reader elsewhere
    ("(module docstring)", a page they cannot see) says nothing there."""
    for path, model in hooks.config_sections(hooks._sources().config):
        lead = inspect.cleandoc(model.__doc__ or "").split("\n\n")[0]
        assert "docstring" not in lead, f"config section {path!r} opens with {lead!r}"


# --- diagrams drawn by the site itself -----------------------------------------------------------------------------
# A ```mermaid fence is rendered by pymdownx.superfences (mkdocs.yml) as <pre class="mermaid"><code>...</code></pre>,
# which the theme's Mermaid draws in the browser: no image file to go stale beside the prose.

MERMAID_BLOCK = re.compile(r'<(pre|div) class="mermaid">(?:<code>)?(.*?)(?:</code>)?</\1>', re.DOTALL)
DIAGRAM_TYPES = frozenset({  # the first word of a Mermaid diagram
    "flowchart", "graph", "sequenceDiagram", "stateDiagram", "stateDiagram-v2", "classDiagram", "erDiagram", "gantt",
    "pie", "journey", "gitGraph", "mindmap", "timeline", "quadrantChart", "sankey-beta", "xychart-beta", "block-beta",
})
DIAGRAM_PAGES = ("architecture", "routing", "responses", "websocket", "sessions", "operations", "bench")


def mermaid_blocks(page: str) -> list[str]:
    """The source of each diagram of a built page, as Mermaid will read it."""
    return [html.unescape(m[2]).strip() for m in MERMAID_BLOCK.finditer(page)]


def bad_diagrams(blocks: list[str]) -> list[str]:
    """The first line of each block that does not open with a known diagram type."""
    firsts = [block.splitlines()[0].strip() if block else "" for block in blocks]
    return [first for first in firsts if (first.split() or [""])[0] not in DIAGRAM_TYPES]


def test_the_guide_pages_draw_their_diagrams(site: Path) -> None:
    """Each page of the request's story has a diagram, every ```mermaid fence of its source is rendered as one (none
    left as a plain code block), and each opens with a diagram type Mermaid knows."""
    for name in DIAGRAM_PAGES:
        blocks = mermaid_blocks(_page(site, name))
        assert blocks, f"docs/{name}.md renders no mermaid diagram"
        fences = re.findall(r"^```mermaid$", (ROOT / "docs" / f"{name}.md").read_text("utf-8"), re.MULTILINE)
        assert len(blocks) == len(fences), f"docs/{name}.md: {len(fences)} mermaid fences, {len(blocks)} rendered"
        assert not bad_diagrams(blocks), f"docs/{name}.md: not a Mermaid diagram type: {bad_diagrams(blocks)}"


def test_the_benchmark_charts_draw_the_figures_on_their_page(site: Path) -> None:
    """A bar of a chart on the benchmarks page is a figure its tables print, as printed."""
    text = (ROOT / "docs" / "bench.md").read_text("utf-8")
    prose = re.sub(r"^```mermaid$.*?^```$", "", text, flags=re.MULTILINE | re.DOTALL)
    charts = [b for b in mermaid_blocks(_page(site, "bench")) if b.startswith("xychart-beta")]
    assert charts, "docs/bench.md has no xychart-beta chart"
    for chart in charts:
        bars = [v.strip() for line in chart.splitlines() if line.strip().startswith("bar")
                for v in line.split("[", 1)[1].rstrip("] ").split(",")]
        assert bars and all(re.search(rf"(?<![\d.]){re.escape(v)}(?![\d.])", prose) for v in bars), chart


def test_a_page_without_a_diagram_or_with_an_unknown_one_is_caught() -> None:
    """The checks themselves: a plain code block is no diagram, an unknown first word is caught."""
    plain = '<div class="language-text highlight"><pre><code>flowchart TB</code></pre></div>'
    assert mermaid_blocks(plain) == []
    drawn = '<pre class="mermaid"><code>flowchart TB\n  A --&gt; B</code></pre><div class="mermaid">flowchat LR</div>'
    assert mermaid_blocks(drawn) == ["flowchart TB\n  A --> B", "flowchat LR"]
    assert bad_diagrams(mermaid_blocks(drawn)) == ["flowchat LR"]


# --- the hook's own checks -----------------------------------------------------------------------------------------

class _Page:
    class file:  # noqa: N801 - the shape MkDocs hands a hook: page.file.src_path
        src_path = "probe.md"


def test_a_page_that_names_a_metric_the_gateway_does_not_have_is_a_warning(hooks: Any,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    text = ("`tiergate_requests_total{outcome=\"success\"}`, `tiergate_time_to_first_token_seconds_bucket`, "
            "`tiergate_key_*`, all names start with `tiergate_`, and `tiergate_request_total`.")
    with caplog.at_level(logging.WARNING):
        assert hooks.on_page_markdown(text, page=_Page()) == text
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["probe.md names the metric tiergate_request_total, which the gateway does not register"]


def test_the_architecture_page_sizes_every_package_from_the_code(site: Path, hooks: Any) -> None:
    """The package table's line counts are counted when the site is built (``<!-- lines: NAME -->``), and every
    package and top-level module of the runtime has a count, once: none goes stale, and a new package is not left
    out."""
    gateway = ROOT / "gateway"
    units = {p.name for p in gateway.iterdir() if p.is_dir() and p.name != "tools" and any(p.glob("*.py"))}
    units |= {p.stem for p in gateway.glob("*.py") if p.stem != "__init__"}
    marked = [unit for found in hooks.LINES.findall((ROOT / "docs" / "architecture.md").read_text())
              for unit in found.split(",")]
    assert sorted(marked) == sorted(units)
    built = _page(site, "architecture")
    for unit in ("pipeline", "errors"):
        assert f"<td style=\"text-align: right;\">{hooks.lines_of(unit):,}</td>" in built
    assert "<!-- lines:" not in built


def test_an_unknown_generated_table_stops_the_build(hooks: Any) -> None:
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match="no generated table named 'nope'"):
        hooks.on_page_markdown("# x\n\n<!-- generated: nope -->\n", page=_Page())


def test_the_markers_are_filled(hooks: Any) -> None:
    filled = hooks.on_page_markdown("<!-- generated: settings -->\n", page=_Page())
    assert "generated" not in filled and "`GATEWAY_PORT`" in filled


# --- every name the docs and docstrings point at exists -----------------------------------------------------------
# A reference is a dotted name in backticks (``gateway.pipeline.exchange.Exchange``), a package path and a name
# (`pipeline/exchange.Exchange`) in the docs, or a Sphinx role in a docstring (:meth:`Recorder.record`, resolved in
# its module, else anywhere in the gateway). A rename that leaves one pointing at nothing fails here.
_DOTTED = re.compile(r"`{1,2}(gateway(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`{1,2}")
_PATH_NAME = re.compile(r"`((?:[a-z_]+/)+[a-z_]+)(?:\.([A-Za-z_][A-Za-z0-9_.]*))?`")
_ROLE = re.compile(r":(?:class|meth|func|data|attr|mod|exc):`~?([A-Za-z_][A-Za-z0-9_.]*)`")
_FILES = frozenset({"yaml", "yml", "json", "md", "py", "lua", "log", "prof", "toml", "txt", "mjs", "sh", "png", "svg"})
_GATEWAY = ROOT / "gateway"


def _has(obj: Any, attr: str) -> Any:
    """``obj.attr``, or True for a field a class only declares (annotations, slots, pydantic fields), or None."""
    if hasattr(obj, attr):
        return getattr(obj, attr)
    if isinstance(obj, type) and any(attr in getattr(k, "__annotations__", {}) or attr in getattr(k, "__slots__", ())
                                     or attr in getattr(k, "model_fields", {}) for k in obj.__mro__):
        return True
    return None


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[-1] in _FILES:
        return True  # a file's name (gateway.log), not a reference
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = _has(obj, attr)
            if obj is None:
                return False
            if obj is True:
                return True
        return True
    return False


def _defined_anywhere() -> set[str]:
    """Every name a gateway module defines at its top or in a class (``Name`` and ``Class.name``)."""
    out: set[str] = set()
    for path in _GATEWAY.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            names = [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else (
                [node.target.id] if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) else [])
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.append(node.name)
            out.update(names)
            if isinstance(node, ast.ClassDef):
                for member in ast.walk(node):  # :meth:`name` in its own class; self.name set in a method
                    if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and member is not node:
                        out.update((f"{node.name}.{member.name}", member.name))
                    elif isinstance(member, ast.AnnAssign | ast.Attribute):
                        target = member.target if isinstance(member, ast.AnnAssign) else member
                        name = target.id if isinstance(target, ast.Name) else (
                            target.attr if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                            and target.value.id == "self" else None)
                        if name:
                            out.update((f"{node.name}.{name}", name))
    return out


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _stale_in_code() -> list[str]:
    anywhere, bad = _defined_anywhere(), []
    for path in sorted(_GATEWAY.rglob("*.py")):
        module = importlib.import_module(_module_of(path))
        source = path.read_text()
        texts = [ast.get_docstring(n) or "" for n in ast.walk(ast.parse(source))
                 if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)]
        texts += [line for line in source.splitlines() if "#" in line]
        for text in texts:
            bad += [f"{path.relative_to(ROOT)}: {m[1]}" for m in _DOTTED.finditer(text) if not _resolves(m[1])]
            for m in _ROLE.finditer(text):
                name = m[1]
                if name.startswith("gateway."):
                    ok = _resolves(name)
                else:
                    first, *rest = name.split(".")
                    found = getattr(module, first, None)
                    ok = (found is not None and all((found := _has(found, a)) is not None for a in rest)) or (
                        name in anywhere or ".".join(name.split(".")[-2:]) in anywhere)
                if not ok:
                    bad.append(f"{path.relative_to(ROOT)}: :{name}:")
    return bad


def _stale_in_docs() -> list[str]:
    bad = []
    for md in [*sorted((ROOT / "docs").rglob("*.md")), README, ROOT / "bench" / "README.md"]:
        text, where = md.read_text(), md.relative_to(ROOT)
        bad += [f"{where}: {m[1]}" for m in _DOTTED.finditer(text) if not _resolves(m[1])]
        for m in _PATH_NAME.finditer(text):
            path, name = m[1], m[2]
            if path.split("/")[0] not in {p.name for p in _GATEWAY.iterdir() if p.is_dir()} or (
                    name and name.split(".")[0] in _FILES):
                continue  # not a module path of the gateway (config/gateway.yaml, tests/..., a file)
            module = _GATEWAY / (path + ".py")
            if not module.exists() and not (_GATEWAY / path).is_dir():
                bad.append(f"{where}: `{m[0].strip('`')}`: no module gateway/{path}")
            elif name and module.exists() and not _resolves(f"gateway.{path.replace('/', '.')}.{name}"):
                bad.append(f"{where}: `{m[0].strip('`')}`")
    return bad


def test_every_name_the_docstrings_point_at_exists() -> None:
    stale = _stale_in_code()
    assert not stale, "docstrings and comments name what no longer exists:\n  " + "\n  ".join(stale)


def test_every_name_the_docs_point_at_exists() -> None:
    stale = _stale_in_docs()
    assert not stale, "the docs name what no longer exists:\n  " + "\n  ".join(stale)


def test_a_stale_reference_is_caught() -> None:
    """The check itself, on names that moved: the exchange's old read_body, and a class that never existed."""
    assert not _resolves("gateway.pipeline.exchange.read_body") and _resolves("gateway.admission.body.read_body")
    assert _resolves("gateway.admission.request.Request.route")  # a declared field counts
