"""The emulator's token budget (docs/emulator.md#budget): with ``tokens_per_minute``, one per-minute budget for every
caller, as OpenAI and Cerebras keep one per organisation. A request is charged as it arrives (its prompt's JSON bytes
/ 4 plus its token limit), every answer reports what is left in the dialect's rate-limit headers, and one the rest
does not cover is a 429. The window restarts a minute after it started."""

from __future__ import annotations

from typing import Any

from gateway.tools.emulator.counts import prompt_of, token_limit
from gateway.tools.emulator.profiles import Profile


class TokenBudget:
    """When the window started (loop time) and the tokens spent in it."""

    def __init__(self) -> None:
        self.start = 0.0
        self.spent = 0

    def charge(self, body: dict[str, Any], budget: int, now: float,
               profile: Profile) -> tuple[list[tuple[bytes, bytes]], bytes | None]:
        """The answer's rate-limit headers in ``profile``'s form, and its 429 body when the rest does not cover it
        (nothing is charged then), else None."""
        if now - self.start >= 60.0:
            self.start, self.spent = now, 0
        cost = len(prompt_of(body)) // 4 + (token_limit(body) or 0)
        spent = self.spent
        fits = spent + cost <= budget
        if fits:
            self.spent += cost
        headers = [(b"x-ratelimit-limit-tokens" + profile.window, b"%d" % budget),
                   (b"x-ratelimit-remaining-tokens" + profile.window, b"%d" % (budget - self.spent)),
                   (b"x-ratelimit-reset-tokens" + profile.window, profile.reset % (self.start + 60.0 - now))]
        return headers, None if fits else profile.refusal(budget, spent, cost)
