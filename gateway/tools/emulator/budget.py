"""The emulator's token budget: with ``tokens_per_minute`` (``--tokens-per-minute``, or ``{"tokens_per_minute": N}``
on ``POST /emulator/config``; 0 turns it off) the emulator keeps one per-minute token budget for everyone who calls
it, as OpenAI and Cerebras do per organisation: each chat-completions or Responses request is charged when it arrives
(its messages' JSON bytes / 4, plus its ``max_tokens``), every answer reports what is left in the dialect's rate-limit
headers (OpenAI's form: ``x-ratelimit-*-tokens`` with resets such as ``12.5s``; Cerebras':
``x-ratelimit-*-tokens-minute`` in seconds), and a request the rest does not cover is answered 429 in the dialect's
error shape. The window starts with the first request and restarts a minute after it started."""

from __future__ import annotations

from typing import Any

from gateway.tools.emulator.counts import prompt_of, token_limit
from gateway.tools.emulator.profiles import Profile


class TokenBudget:
    """One per-minute window (module docstring): when it started (loop time) and the tokens spent in it."""

    def __init__(self) -> None:
        self.start = 0.0
        self.spent = 0

    def charge(self, body: dict[str, Any], budget: int, now: float,
               profile: Profile) -> tuple[list[tuple[bytes, bytes]], bytes | None]:
        """Charge a request of ``body`` against ``budget`` tokens a minute at ``now``; returns the rate-limit headers
        of its answer in ``profile``'s form, and the body of its 429 when the rest does not cover it (nothing is
        charged then), else None."""
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
