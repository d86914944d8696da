"""The emulator's prompt cache (docs/emulator.md#prompt-cache), enough for the demo and the tests to show
agent-session affinity at work. Like OpenAI's and Cerebras' caches it matches exact prefixes within one
``prompt_cache_key`` and forgets a prefix ``ttl`` seconds after its last use; unlike them it counts whole tokens from
the first (they cache prompts of 1,024 tokens or more, in blocks of 128), because the tests' prompts are short."""

from __future__ import annotations

import os
from collections import OrderedDict

BYTES_PER_TOKEN = 4


class PromptCache:
    """At most ``per_key`` prompts for each of at most ``keys`` cache keys; times in seconds of the emulator's loop
    clock."""

    def __init__(self, ttl: float, keys: int = 1024, per_key: int = 16) -> None:
        self.ttl = ttl
        self.keys = keys
        self.per_key = per_key
        self._by_key: OrderedDict[str, list[tuple[bytes, float]]] = OrderedDict()

    def use(self, key: str, prompt: bytes, now: float) -> int:
        """The tokens of its longest live prefix among the prompts kept; ``prompt`` is then kept as used now."""
        kept = [(p, at) for p, at in self._by_key.get(key, ()) if now - at < self.ttl]
        best, match = 0, -1
        for i, (seen, _) in enumerate(kept):
            common = len(os.path.commonprefix([seen, prompt]))
            if common > best:
                best, match = common, i
        if match >= 0 and best >= len(kept[match][0]) - 1:
            kept.pop(match)  # it extends a kept one (the next step of a conversation: all but its closing "]")
        kept.append((prompt, now))
        self._by_key[key] = kept[-self.per_key:]
        self._by_key.move_to_end(key)
        while len(self._by_key) > self.keys:
            self._by_key.popitem(last=False)
        return best // BYTES_PER_TOKEN
