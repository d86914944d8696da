"""Ids of what the Responses bridge makes, random as OpenAI's are; the ``tg`` in their prefixes lets the gateway
tell an id it made and no longer holds (expired) from one it never saw."""

from __future__ import annotations

import os

ID_PREFIX = "resp_tg"  # the ids of responses the gateway made: it knows an unknown one of these expired


def new_id(prefix: str) -> str:
    return f"{prefix}{os.urandom(16).hex()}"
