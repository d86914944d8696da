"""``tiergate bench`` (docs/bench.md#tiergate-bench): a mix of real-looking chat completions sent through a running
gateway, the tiers compared. Each request streams with ``stream_options.include_usage`` (the completion tokens come from
the upstream's usage) and is timed at the client: TTFT to the first token-bearing chunk, decode speed by the gateway's
formula, (t_last - t_first) / (completion_tokens - the first chunk's tokens). Requests are grouped by the
``x-tiergate-tier`` header (by model when the server is not Tiergate); cost is the delta of the gateway's
``tiergate_cost_usd_total``, other traffic included.

The client is aiohttp (a runtime dependency), so the command works from a plain install; every loop is bounded by
``--requests`` and every request by ``--timeout``. Its modules: ``mix``, ``client``, ``figures``, ``chart``,
``command``; this face re-exports what the command line, the agent loop and the tests use.
"""

from __future__ import annotations

from gateway.tools.loadtest.client import Result, run, send
from gateway.tools.loadtest.command import main
from gateway.tools.loadtest.figures import TierStats, percentile, summary
from gateway.tools.loadtest.mix import parse_mix, plan

__all__ = ["Result", "TierStats", "main", "parse_mix", "percentile", "plan", "run", "send", "summary"]
