"""The emulator's prompt cache: what a provider's prefix cache does, enough for the demo and the tests to show
agent-session affinity at work (a warm prefix is reported as cached tokens and shortens the first token).

Like OpenAI's and Cerebras' caches it matches exact prefixes of the prompt, within one ``prompt_cache_key`` (or, with
none, the upstream's whole traffic), and forgets a prefix ``ttl`` seconds after it was last used. Unlike them it counts
in whole tokens from the first (the providers cache in blocks of 128 tokens and only prompts of 1,024 tokens or more):
the tests' prompts are short. A prompt's tokens are its messages' (or input's) JSON bytes / 4, the emulator's count.
"""

from __future__ import annotations

import os
from collections import OrderedDict

BYTES_PER_TOKEN = 4


class PromptCache:
    """Prefixes of recent prompts (module docstring): at most ``per_key`` prompts for each of at most ``keys`` cache
    keys, each kept ``ttl`` seconds after its last use (times: the emulator's loop clock, seconds)."""

    def __init__(self, ttl: float, keys: int = 1024, per_key: int = 16) -> None:
        self.ttl = ttl
        self.keys = keys
        self.per_key = per_key
        self._by_key: OrderedDict[str, list[tuple[bytes, float]]] = OrderedDict()

    def use(self, key: str, prompt: bytes, now: float) -> int:
        """The tokens of ``prompt`` the cache holds under ``key`` at ``now`` (its longest live prefix among the prompts
        kept), then ``prompt`` is kept as used now."""
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
