"""The Redis scripts of the shared state, composed from the Lua files in ``lua/`` (each says its keys, arguments and
reply). The quota, rest and key scripts start with ``safe.lua``: a key holding something the gateway does not keep there
is dropped and counts from nothing, so that no stray value fails a script for every request. They run with EVALSHA,
loaded each time the subscriber connects."""

from __future__ import annotations

from importlib import resources

# The keys of one upstream's quota scripts, K[1..6] under the one key they declare (the upstream's base, whose hash tag
# puts them all in its Redis Cluster slot): quota requests, quota tokens (the estimates), sent requests, sent tokens
# (running totals of reservations), the in-flight set (members "{sent tokens}:{tokens}", scored by when they leave it
# if nothing removes them: a replica that died mid-flight), and its totals (a hash: r, t). Their arguments A[...] come
# in one string, joined by the unit separator: measured, redis-py's packing of each argument was most of the CPU a
# request spent on Redis (18 arguments each, twice per request). quota_keys.lua lists the same suffixes.
QUOTA_KEYS = (":quota:requests", ":quota:tokens", ":sent:requests", ":sent:tokens", ":inflight", ":inflight:n")
SEP = "\x1f"


def lua(name: str) -> str:
    return resources.files("gateway.state").joinpath("lua", name).read_text()


SAFE = lua("safe.lua")
LAND = SAFE + lua("quota_keys.lua") + lua("land.lua")
ADMIT = LAND + lua("admit.lua")
OBSERVE = LAND + lua("observe.lua")
LANDED = LAND + lua("landed.lua")
REST = SAFE + lua("rest.lua")
HISTORY = lua("history.lua")
STORE = lua("store.lua")
STORE_PUT = STORE + lua("store_put.lua")
STORE_DROP = STORE + lua("store_drop.lua")
KEY_RESERVE = SAFE + lua("key_reserve.lua")
KEY_SETTLE = SAFE + lua("key_settle.lua")
SESSION_BEGIN = lua("session_begin.lua")
SESSION_STEP = lua("session_step.lua")
SESSION_INDEX = lua("session_index.lua")
