"""MkDocs hook: the reference tables that mirror code are generated from it, never written by hand.

A page asks for a table with a marker on a line of its own, ``<!-- generated: NAME -->``:

* ``metric-families``: every metric family the gateway registers (name as exported, type, labels, help, how
  ``--workers N`` merges a gauge), read from the registry :class:`Metrics` builds, with the labels and buckets of
  its table (``FAMILIES``);
* ``metric-buckets``: each histogram's buckets;
* ``settings``: the process settings, one ``GATEWAY_*`` variable each (with their defaults);
* ``config``: every field of the YAML config file, by its dotted path, one section per part with its docstring;
* ``error-classes``: the error tree's classes the gateway answers with: status, ``type``, ``code``.

A table cell asks for a size with ``<!-- lines: NAME[,NAME...] -->``: the lines of Python in those packages
(``gateway/NAME/``, every module under it) or top-level modules (``gateway/NAME.py``), counted at build time
(:func:`lines_of`), so that the architecture page's package table never goes stale.

An unknown marker stops the build, and so does (as a warning, under ``--strict``) a page that names a ``tiergate_*``
metric the gateway does not register: a renamed metric cannot stay in the prose.

:func:`_sources` is the one place that imports the gateway: when a module moves, one line changes here.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import types
import typing
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel

log = logging.getLogger(f"mkdocs.plugins.{__name__}")

MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)
LINES = re.compile(r"<!-- lines: ([\w,]+) -->")
GATEWAY = Path(__file__).resolve().parents[1] / "gateway"
METRIC_NAME = re.compile(r"\btiergate_[a-z0-9_]*\*?")  # a trailing * is a family of names (tiergate_key_*)
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": (), "summary": ("_sum", "_count", "_created"), "info": ("_info",)}


@cache
def _sources() -> types.SimpleNamespace:
    """Every gateway name the generated tables read: the single place this hook (and tests/test_docs.py, through it)
    imports the gateway."""
    from gateway.config.load import REDIS_URL_VAR
    from gateway.config.schema import GatewayConfig
    from gateway.config.settings import Settings
    from gateway.errors import ConfigError, GatewayError, UpstreamStatusError
    from gateway.observability.families import FAMILIES, PREFIX
    from gateway.observability.metrics import Metrics

    return types.SimpleNamespace(families=FAMILIES, prefix=PREFIX, metrics=Metrics, config=GatewayConfig,
                                 settings=Settings, redis_url_var=REDIS_URL_VAR, error=GatewayError,
                                 startup_error=ConfigError, relayed_error=UpstreamStatusError)


# --- metrics -------------------------------------------------------------------------------------------------------

def registered() -> list[tuple[str, str, str]]:
    """(family name, type, help) of every metric family the gateway registers, in registration order."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    _sources().metrics(registry, models=(), routes=())
    return [(family.name, family.type, family.documentation) for family in registry.collect()]


def exported_names(name: str, kind: str) -> tuple[str, ...]:
    """The sample names a family of ``kind`` is exported under (``_total`` for a counter, ``_bucket``... for a
    histogram)."""
    return (name, *(name + suffix for suffix in SUFFIXES.get(kind, ())))


def _shown_name(name: str, kind: str) -> str:
    return f"`{name}_total`" if kind == "counter" else f"`{name}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _metric_families() -> str:
    src = _sources()
    table = {f"{src.prefix}_{family.name}": family for family in src.families}
    rows = ["| metric | type | labels | help | with `--workers N` |", "|---|---|---|---|---|"]
    for name, kind, help_text in registered():
        family = table.get(name)
        labels = ", ".join(f"`{label}`" for label in family.labels) if family and family.labels else "—"
        merge = "added up" if kind != "gauge" else f"`{family.multiprocess_mode or 'all'}`" if family else "—"
        rows.append(f"| {_shown_name(name, kind)} | {kind} | {labels} | {_cell(help_text)} | {merge} |")
    return "\n".join(rows)


def _metric_buckets() -> str:
    src = _sources()
    rows = ["| histogram | buckets (upper bounds; `+Inf` is added) |", "|---|---|"]
    for family in src.families:
        if family.buckets is not None:
            bounds = ", ".join(f"{b:g}" for b in family.buckets)
            rows.append(f"| `{src.prefix}_{family.name}` | {bounds} |")
    return "\n".join(rows)


# --- settings and config -------------------------------------------------------------------------------------------

def _type_name(annotation: Any, section: str = "") -> str:
    """A field's type in words a YAML author reads: ``number or null``, ``list of text``, ``"openai" or "cerebras"``;
    a nested part of the file is a link to its ``section``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " or ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a, section) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0], section)}"
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1], section)}"
    if annotation is type(None):
        return "null"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return f"[section](#{section})"
    names = {str: "text", int: "integer", float: "number", bool: "boolean", Path: "path"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _value(value: Any, name: str = "") -> str:
    if isinstance(value, Path):
        home = str(Path.home())
        return f"`{str(value).replace(home, '~', 1) if str(value).startswith(home) else value}`"
    if isinstance(value, BaseModel):
        return "its fields' defaults"
    shown = f"`{json.dumps(value)}`"
    if "bytes" in name and isinstance(value, int) and value >= 1024:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value % size == 0:
                return f"{shown} ({value // size} {unit})"
    return shown


def _default(name: str, field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        return _value(field.default_factory(), name)
    return _value(field.default, name)


def _nested(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """The config section a field holds, and the path step to it (``[]`` for a list, ``.<name>`` for a map)."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation, ""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list:
        found = _nested(args[0])
        return (found[0], "[]" + found[1]) if found else None
    if origin is dict:
        found = _nested(args[1])
        return (found[0], ".<name>" + found[1]) if found else None
    for arg in args:  # X | None
        found = _nested(arg)
        if found:
            return found
    return None


def config_sections(model: type[BaseModel], path: str = "",
                    above: tuple[type[BaseModel], ...] = ()) -> Iterator[tuple[str, type[BaseModel]]]:
    """(dotted path, model) of the config file's top level and of every section below it, depth first; a section
    that holds its own kind again (prices per service tier are prices) is listed once, where it first appears."""
    yield path, model
    for name, field in model.model_fields.items():
        found = _nested(field.annotation)
        if found and found[0] is not model and found[0] not in above:
            yield from config_sections(found[0], f"{path}.{name}{found[1]}" if path else f"{name}{found[1]}",
                                       (*above, model))


def _anchor(path: str) -> str:
    return "config-" + (re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-") or "top")


def _prose(doc: str, fields: Iterable[str]) -> str:
    """A config class's docstring as Markdown: Sphinx roles become code, and where a paragraph goes through the
    class's own fields (``name: what it is; other: ...``) each field starts an item of a list."""
    names = "|".join(sorted(map(re.escape, fields), key=len, reverse=True))
    marker = re.compile(rf"(?:^|(?<=[;.] ))((?:{names})(?: / (?:{names}))*): ") if names else None
    out: list[str] = []
    for paragraph in re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", inspect.cleandoc(doc)).split("\n\n"):
        text = " ".join(paragraph.split())
        starts = list(marker.finditer(text)) if marker else []
        if not starts:
            out.append(text)
            continue
        lead = text[:starts[0].start()].strip()
        items = [lead] if lead else []
        items.append("")
        for m, end in zip(starts, [*(n.start() for n in starts[1:]), len(text)], strict=True):
            named = " / ".join(f"`{n}`" for n in m.group(1).split(" / "))
            items.append(f"- {named}: {text[m.end():end].strip()}")
        out.append("\n".join(items).strip("\n"))
    return "\n\n".join(out)


def _config() -> str:
    parts: list[str] = []
    sections = list(config_sections(_sources().config))
    where = {model: path for path, model in reversed(sections)}  # each model's first section
    listed = {path for path, _ in sections}
    for path, model in sections:
        title = f"`{path}`" if path else "The top level"
        parts += [f"### {title} {{ #{_anchor(path)} }}", "", _prose(model.__doc__ or "", model.model_fields), "",
                  "| field | type | default |", "|---|---|---|"]
        for name, field in model.model_fields.items():
            full = f"{path}.{name}" if path else name
            found = _nested(field.annotation)
            section = ""
            if found:  # a section of its own, or (a recursive one) the section of its kind
                section = _anchor(full + found[1] if full + found[1] in listed else where[found[0]])
            parts.append(f"| `{full}` | {_type_name(field.annotation, section)} | {_default(name, field)} |")
        parts.append("")
    return "\n".join(parts)


def setting_variables() -> list[tuple[str, Any]]:
    """(environment variable, field) of every process setting; the field is None for the Redis URL, which the config
    loader reads."""
    settings = _sources().settings
    prefix = settings.model_config.get("env_prefix", "")
    found: list[tuple[str, Any]] = []
    for name, field in settings.model_fields.items():
        alias = field.validation_alias if isinstance(field.validation_alias, str) else None
        found.append((alias or f"{prefix}{name}".upper(), field))
    found.append((_sources().redis_url_var, None))
    return found


def _settings() -> str:
    rows = ["| variable | type | default |", "|---|---|---|"]
    for variable, field in setting_variables():
        if field is None:
            rows.append(f"| `{variable}` | text | unset: [`state.redis_url`](#{_anchor('state')}) |")
        else:
            rows.append(f"| `{variable}` | {_type_name(field.annotation)} | {_default(variable.lower(), field)} |")
    return "\n".join(rows)


# --- errors --------------------------------------------------------------------------------------------------------

def _first_paragraph(doc: str | None) -> str:
    text = inspect.cleandoc(doc or "").split("\n\n")[0]
    return re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", " ".join(text.split()))


def _error_classes() -> str:
    src = _sources()
    rows = ["| class | status | `type` | `code` | when |", "|---|---|---|---|---|"]
    pending = list(src.error.__subclasses__())
    while pending:
        cls = pending.pop(0)
        pending[:0] = cls.__subclasses__()  # depth first: a subclass right below its base
        if issubclass(cls, src.startup_error):
            continue  # start-up only, never an HTTP answer
        if issubclass(cls, src.relayed_error):
            status = kind = code = "the upstream's"
        else:
            status, kind, code = str(cls.status), f"`{cls.error_type}`", f"`{cls.code}`" if cls.code else "null"
        rows.append(f"| `{cls.__name__}` | {status} | {kind} | {code} | {_cell(_first_paragraph(cls.__doc__))} |")
    return "\n".join(rows)


GENERATED = {"metric-families": _metric_families, "metric-buckets": _metric_buckets, "settings": _settings,
             "config": _config, "error-classes": _error_classes}


# --- package sizes -------------------------------------------------------------------------------------------------

def lines_of(unit: str) -> int:
    """Lines of Python in ``gateway/<unit>/`` (every module under it) or in ``gateway/<unit>.py``.

    Raises:
        PluginError: neither exists (a marker naming a package that moved)."""
    folder = GATEWAY / unit
    files = sorted(folder.rglob("*.py")) if folder.is_dir() else [GATEWAY / f"{unit}.py"]
    if not all(f.is_file() for f in files) or not files:
        from mkdocs.exceptions import PluginError

        raise PluginError(f"<!-- lines: {unit} -->: there is no gateway/{unit}/ nor gateway/{unit}.py")
    return sum(len(f.read_text(encoding="utf-8").splitlines()) for f in files)


# --- the hook ------------------------------------------------------------------------------------------------------

@cache
def _known_metric_names() -> frozenset[str]:
    return frozenset(n for name, kind, _ in registered() for n in exported_names(name, kind))


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Fill the page's markers, and warn about any ``tiergate_*`` metric it names that the gateway does not have."""

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATED:
            from mkdocs.exceptions import PluginError

            raise PluginError(f"{page.file.src_path}: no generated table named {name!r} (known: {sorted(GENERATED)})")
        return GENERATED[name]()

    named = {found for found in METRIC_NAME.findall(markdown) if not found.endswith(("*", "_"))}
    for name in sorted(named - _known_metric_names()):
        log.warning("%s names the metric %s, which the gateway does not register", page.file.src_path, name)
    markdown = LINES.sub(lambda m: f"{sum(lines_of(unit) for unit in m.group(1).split(',')):,}", markdown)
    return MARKER.sub(fill, markdown)
