"""The ids of what the gateway's Responses bridge makes: ``resp_tg...`` responses, ``msg_tg``/``fc_tg``/``rs_tg`` items
(random, as OpenAI's are), so that an id of this prefix the gateway no longer holds is known to have expired."""

from __future__ import annotations

import os

ID_PREFIX = "resp_tg"  # the ids of responses the gateway made: it knows an unknown one of these expired


def new_id(prefix: str) -> str:
    """A fresh id: ``resp_tg<32 hex>`` for responses, ``msg_tg...``, ``fc_tg...``, ``rs_tg...`` for items."""
    return f"{prefix}{os.urandom(16).hex()}"
