"""Upstream dialects, one module each beside ``base``; :func:`of` picks an upstream's. Modules are found by looking, so
adding a dialect is its own module (and its name in ``gateway.config.upstreams``): nothing here may list them."""

from __future__ import annotations

import importlib
import pkgutil

from gateway.config.upstreams import UpstreamConfig
from gateway.upstream.dialects.base import Dialect


def _found() -> dict[str, Dialect]:
    out: dict[str, Dialect] = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"):
        loaded = importlib.import_module(f"{__name__}.{module}")
        for value in vars(loaded).values():
            if isinstance(value, type) and issubclass(value, Dialect) and value.__module__ == loaded.__name__:
                out[value.name] = value()
    return out


DIALECTS: dict[str, Dialect] = _found()
# the dialects whose chunks add a member: each one's usage is read for every upstream (Dialect.vendor_usage)
Dialect.vendors = tuple(d for d in DIALECTS.values() if d.member is not None)


def of(upstream: UpstreamConfig) -> Dialect:
    """Never a KeyError: config validation admits only the names found here."""
    return DIALECTS[upstream.dialect]
