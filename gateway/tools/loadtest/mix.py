"""What ``tiergate bench`` sends: a mix of models by weight (``--mix``) and real-looking prompts, planned in a
reproducible order."""

from __future__ import annotations

import math
import random

PROMPTS = (
    "Write a Python function that parses an ISO 8601 duration like P3DT4H12M into seconds, with tests.",
    "Summarise the trade-offs between optimistic and pessimistic locking for a busy checkout service.",
    "Explain to a new on-call engineer how to read a p95 latency graph and when to page someone.",
    "Draft a short, friendly reply to a customer whose order arrived two days late.",
    "Given a table orders(id, user_id, total, created_at), write SQL for each user's rolling 30-day spend.",
    "What are three ways to make a React list of 10,000 rows scroll smoothly? Keep it practical.",
    "Translate into French: 'The meeting moved to Thursday at 10; bring the quarterly numbers.'",
    "Refactor this into idiomatic Go and explain each change: for i := 0; i < len(xs); i++ { sum = sum + xs[i] }",
    "Plan a three-step agent that reads a failing CI log, finds the test, and proposes a one-line fix.",
    "Give me a regex that matches UK postcodes, and two examples it should reject.",
)
SYSTEM = "You are a helpful, concise assistant."


def parse_mix(text: str) -> list[tuple[str, float]]:
    """``"model:weight,model:weight"``; a model without a weight counts 1. Raises ValueError for an empty mix, a bad
    weight, or weights that add up to 0."""
    mix = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        model, sep, weight = part.rpartition(":")
        if not sep or not model:
            model, weight = part, "1"
        try:
            w = float(weight)
        except ValueError:
            raise ValueError(f"--mix: bad weight {weight!r} for {model!r}") from None
        if w < 0 or not math.isfinite(w):
            raise ValueError(f"--mix: weight of {model!r} must be a finite number >= 0")
        mix.append((model, w))
    if not mix or sum(w for _, w in mix) <= 0:
        raise ValueError("--mix: give at least one model with a weight > 0, e.g. gpt-5.6-sol-fast:0.5,gpt-5.6:0.5")
    return mix


def plan(mix: list[tuple[str, float]], n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` (model, prompt) pairs drawn from the mix's weights (shuffled, reproducible with ``seed``)."""
    rng = random.Random(seed)
    total = sum(w for _, w in mix)
    counts = [int(n * w / total) for _, w in mix]
    by_rest = sorted(range(len(mix)), key=lambda i: n * mix[i][1] / total - counts[i], reverse=True)
    for i in by_rest[: n - sum(counts)]:
        counts[i] += 1
    models = [m for (m, _), c in zip(mix, counts, strict=True) for _ in range(c)]
    rng.shuffle(models)
    return [(m, rng.choice(PROMPTS)) for m in models]
