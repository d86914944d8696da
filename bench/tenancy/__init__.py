"""Tenancy soak: several gateway keys share one gateway for minutes, one of them hostile, others spending budgets.

    .venv/bin/python -m bench.tenancy [--minutes 3] [--concurrency 24] [--max-requests N] [--seed 0] [--out DIR]

Starts two emulated upstreams (fast: Cerebras dialect, standard: OpenAI dialect, which sells ``service_tier:
priority`` at twice its default prices) and a gateway with gateway keys in front of them, then runs, for
``--minutes`` (or ``--max-requests`` in all), ``--concurrency`` workers split over four keys
(:mod:`bench.tenancy.load`):

* ``interactive``: streamed chat completions with ``max_tokens``, both tiers (60,000 tokens a minute, 1 USD a day),
  and now and then a file of its own;
* ``batch``: whole chat completions, standard tier only (300 requests a minute);
* ``agent``: Responses API turns on the fast tier (through the bridge), each continuing the last with
  ``previous_response_id``; the ids it made are what the hostile key goes after;
* ``hostile`` (20,000 tokens a minute, 0.3 USD a day), at random: the double slash with ``max_tokens`` far over its
  limit; long streams it leaves before the usage; legacy completions streamed through the passthrough without usage;
  another key's response (``GET``, ``previous_response_id``, ``DELETE``) and file; bodies every upstream answers 500;
  1 MiB bodies; legacy completions far over its limit; ``/metrics`` with its gateway key; batches over another key's
  file in bodies the gateway cannot read (:mod:`bench.tenancy.tricks`); objects 260 deep on chat, Responses and a
  WebSocket-mode message.

Beside them (:mod:`bench.tenancy.phases`, :mod:`bench.tenancy.flood`):

* ``runs`` (every run ``max_steps: 3`` and a small ``max_usd``): bursts of concurrent first steps of fresh runs;
* ``pinned`` (pinned to one run with the same budgets): one burst slipping the pin, then its refusals;
* ``tiered`` (``tiers: [standard]``): ``service_tier: priority`` on the passthrough's legacy completions;
* the hostile key's WebSocket ping floods, a few bounded rounds, RSS measured around each.

Every answer is checked against what a correct gateway gives; each trick gets a held / not held verdict. Every five
seconds it reads the gateway's RSS and each key's charged tokens and USD (``tiergate_key_tokens_total``,
``tiergate_key_cost_usd_total``, with a scrape token). It reports per key what was sent, admitted and refused (by
status and error code) and charged against its limits (the most tokens charged in one UTC minute, the USD of the run,
the steps and USD of each run), every wrong answer, and RSS over time (:mod:`bench.tenancy.report`). Writes
``tenancy.json`` and ``tenancy.md`` to ``--out`` (default ``bench/out/tenancy``). Not run in CI; ``--minutes 0.3
--concurrency 8`` is a quick check.
"""
