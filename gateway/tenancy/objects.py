"""Which gateway key owns which object of the rest of the API (files, uploads, batches, vector stores, fine-tuning jobs,
assistants, threads, conversations, containers, evals, videos), so that with gateway keys on what a key stored only
that key reaches.

Every key's passthrough request goes to the same upstream account with the gateway's own credential, and an upstream
answers any id the account holds: without this, key B could list key A's files, read their content, cancel A's batch
or attach A's file to its own vector store. OpenAI scopes objects to the project that made them (API reference:
another project's id is "No such File object"); the gateway scopes them to the key:

* a ``POST`` that answers a JSON object with an ``id`` makes that id the requesting key's (:meth:`Owners.claim`);
* a path that names an object (an ``{id}`` segment of its route: ``gateway.wire.routes``) is served only when every
  object it names is the requesting key's, else answered 404 as an unknown id is (never sent upstream);
* a body that names objects (:data:`REFERENCES`: ``input_file_id``, ``file_ids``, ``training_file``, ...) likewise,
  on the passthrough and on the hot path (a chat message's ``file.file_id``, a Responses ``input_file``, a
  ``file_search`` tool's ``vector_store_ids``, a ``conversation``, a ``code_interpreter`` ``container``:
  :func:`named_objects`), since a model call reads what it names with the same credential;
* a list (``GET /v1/files``, ``/v1/batches``, ...) shows the key's own objects only (:func:`filter_list`).

An id the gateway never saw made (made before the gateway, or straight at the provider) is nobody's: no key reaches it.
Without gateway keys nothing of this applies. Model ids (``/v1/models/{id}``) are not objects.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import orjson

# body fields that name objects (OpenAI API reference: batches, fine-tuning, vector stores, assistants, threads,
# responses, conversations, containers, evals)
REFERENCES = frozenset({"input_file_id", "file_id", "file_ids", "training_file", "validation_file", "vector_store_id",
                        "vector_store_ids", "assistant_id", "thread_id", "conversation", "container_id",
                        "container", "previous_response_id", "fine_tuned_model_checkpoint", "upload_id", "eval_id",
                        "video_id"})
# what a model call's body may name (named_objects): all of REFERENCES but previous_response_id, which the response
# store owns
MODEL_CALL_REFERENCES = REFERENCES - {"previous_response_id"}
# a chat message's members that hold what the model made (its tool calls: names and argument strings), not walked:
# half the nodes of an agent's history (only there: a prompt variable may be called anything)
MADE_BY_THE_MODEL = frozenset({"tool_calls", "function_call"})


def references(body: Any, names: frozenset[str] = REFERENCES, items: bool = False) -> list[str]:
    """The object ids a parsed JSON request body names (members called one of ``names``: a string, a list's strings,
    or an object's ``id``, as ``{"conversation": {"id": ...}}``), at any depth: every object and list is visited once,
    without recursion (``thread.messages[].attachments[].file_id`` is 5 levels down), a string member costing a type
    check (names are read as parsed, so a JSON escape in one hides nothing). ``items``: the ``id`` of each Responses
    ``item_reference`` too (an item of a stored response or conversation, which the upstream resolves across the
    account)."""
    out: list[str] = []
    stack = [body]
    pop, push = stack.pop, stack.append  # bound once: called per node
    while stack:
        node = pop()
        if type(node) is dict:
            for k, v in node.items():
                t = type(v)
                if t is str:
                    if k in names:
                        out.append(v)
                    elif items and v == "item_reference" and k == "type" and type(node.get("id")) is str:
                        out.append(node["id"])
                elif t is list or t is dict:
                    if k in names:
                        if t is list:
                            out.extend(x for x in v if type(x) is str)
                        elif type(v.get("id")) is str:
                            out.append(v["id"])
                    push(v)
        elif type(node) is list:
            stack.extend(v for v in node if type(v) is dict or type(v) is list)
    return out


def named_objects(body: Any) -> list[str]:
    """The object ids a chat completion or Responses request body names (:func:`references` of
    :data:`MODEL_CALL_REFERENCES`, wherever they sit: a content part's ``file_id``, a prompt variable's, a tool's
    ``vector_store_ids``), and each ``item_reference``'s id (no key made one through the gateway: refused). A chat
    message's tool calls are not walked (:data:`MADE_BY_THE_MODEL`). Measured on an idle machine: 0.8 µs for a
    one-message body, 16 µs for a 101-message agent history with 50 tool calls (60 KB; orjson parses it in 37 µs),
    where substring searches of the body's bytes for the names took 145 µs."""
    messages = body.get("messages") if type(body) is dict else None
    if type(messages) is not list:
        return references(body, MODEL_CALL_REFERENCES, items=True)
    out = references({k: v for k, v in body.items() if k != "messages"}, MODEL_CALL_REFERENCES, items=True)
    for message in messages:
        if type(message) is not dict:
            out += references(message, MODEL_CALL_REFERENCES, items=True)
            continue
        for k, v in message.items():
            t = type(v)
            if t is str:
                if k in MODEL_CALL_REFERENCES:
                    out.append(v)
            elif (t is list or t is dict) and k not in MADE_BY_THE_MODEL:
                out += references({k: v}, MODEL_CALL_REFERENCES, items=True)
    return out


def created_ids(answer: bytes) -> list[str]:
    """The ids a ``POST`` made: the ``id`` of the JSON object it answered with, and the ``file`` a completed upload
    made (Uploads API, "Complete upload"). Never the ids of other members: an answer echoes the request's
    ``metadata`` (``{"metadata": {"id": "<another key's file>"}}`` once took that file)."""
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return []
    if not isinstance(parsed, dict):
        return []
    found = [parsed.get("id")]
    made = parsed.get("file")
    if parsed.get("object") == "upload" and isinstance(made, dict):
        found.append(made.get("id"))
    return [i for i in found if isinstance(i, str) and i]


async def filter_list(answer: bytes, owner: str, owners: Owners) -> bytes | None:
    """A list answer (``{"object": "list", "data": [...], "first_id", "last_id", "has_more"}``) with only ``owner``'s
    objects in ``data`` (its ``first_id`` / ``last_id`` those of what is left); None when it is no list."""
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    data = parsed.get("data") if isinstance(parsed, dict) else None
    if not isinstance(data, list):
        return None
    ids = [item.get("id") if isinstance(item, dict) else None for item in data]
    mine = await owners.owned([i for i in ids if isinstance(i, str)], owner)
    kept = [item for item, i in zip(data, ids, strict=True) if isinstance(i, str) and i in mine]
    parsed["data"] = kept
    if "first_id" in parsed:
        parsed["first_id"] = kept[0]["id"] if kept else None
    if "last_id" in parsed:
        parsed["last_id"] = kept[-1]["id"] if kept else None
    return orjson.dumps(parsed)


class Owners(Protocol):
    """Who owns which object id (module docstring): :class:`MemoryOwners`, or Redis (``gateway.state.redis``)."""

    async def owner(self, object_id: str) -> str | None:
        """The key that made ``object_id``, or None (nobody's: unknown, or forgotten)."""
        ...

    async def owned(self, object_ids: Iterable[str], owner: str) -> set[str]:
        """Those of ``object_ids`` that ``owner`` made."""
        ...

    async def claim(self, object_id: str, owner: str) -> None:
        """``owner`` made ``object_id``."""
        ...


class MemoryOwners:
    """An :class:`Owners` in this process: at most ``max_items`` ids, each forgotten ``ttl`` seconds after it was
    claimed (when full, the oldest of the key holding the most go first), and at most ``key_share`` of them one key's
    (past it, its own oldest go: a key holding fewer ids than another never loses one to it). ``clock``: seconds
    (``time.monotonic``)."""

    def __init__(self, max_items: int, ttl: float, clock: Callable[[], float] = time.monotonic,
                 key_share: float = 0.25) -> None:
        self.max_items = max_items
        self.ttl = ttl
        self.clock = clock
        self.per_key = max(1, int(max_items * key_share))
        self._owners: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (expires, owner)
        self._by_key: dict[str, OrderedDict[str, None]] = {}  # owner -> its ids, oldest first

    def __len__(self) -> int:
        return len(self._owners)

    async def owner(self, object_id: str) -> str | None:
        found = self._owners.get(object_id)
        if found is None:
            return None
        if found[0] <= self.clock():
            self._drop(object_id)
            return None
        return found[1]

    async def owned(self, object_ids: Iterable[str], owner: str) -> set[str]:
        return {i for i in object_ids if await self.owner(i) == owner}

    async def claim(self, object_id: str, owner: str) -> None:
        self._drop(object_id)
        self._owners[object_id] = (self.clock() + self.ttl, owner)
        mine = self._by_key.setdefault(owner, OrderedDict())
        mine[object_id] = None
        while len(mine) > self.per_key:
            self._drop(next(iter(mine)))
        while len(self._owners) > self.max_items:
            # full: the key holding the most ids gives up its oldest (not a quieter key)
            largest = max(self._by_key.values(), key=len)
            self._drop(next(iter(largest)))

    def _drop(self, object_id: str) -> None:
        found = self._owners.pop(object_id, None)
        if found is None:
            return
        mine = self._by_key[found[1]]
        del mine[object_id]
        if not mine:
            del self._by_key[found[1]]
