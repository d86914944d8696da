"""Start-up leaves the garbage collector little to walk: the app's lifespan freezes what imports and the app
built (``gateway.app.freeze_startup_objects``), so a full collection no longer stalls every relayed stream for
tens of milliseconds (the pause itself is measured by ``bench/``, not timed here), and young collections run ten
times less often than CPython's default."""

from __future__ import annotations

import gc
from pathlib import Path

import yaml

from gateway.app import GEN0_THRESHOLD, create_app
from gateway.config.load import load_config

from conftest import default_config


async def test_lifespan_freezes_the_objects_start_up_made(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(default_config("http://127.0.0.1:9/v1", "http://127.0.0.1:9/v1")))
    app = create_app(load_config(path, {"FAKE_FAST_KEY": "k", "FAKE_STD_KEY": "k"}))
    gc.unfreeze()
    threshold = gc.get_threshold()
    gc.set_threshold(700, *threshold[1:])
    try:
        assert gc.get_freeze_count() == 0
        async with app.app.router.lifespan_context(app.app):
            frozen = gc.get_freeze_count()
            young = len(gc.get_objects())
        assert frozen > 10_000, frozen  # modules, classes, config, routes, metrics: all of start-up
        assert young < frozen / 10, (young, frozen)  # a full collection walks only what came after
        assert gc.get_threshold()[0] == GEN0_THRESHOLD  # young collections every 7,000 allocations, not 700
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
