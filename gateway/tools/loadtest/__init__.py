"""``tiergate bench``: send a mix of real-looking chat completions through a running gateway and compare the tiers.

Each request streams (``stream_options.include_usage``, so the completion tokens come from the upstream's usage)
and is timed at the client: TTFT is the time from sending the request to the first token-bearing chunk; decode
speed uses the gateway's formula, (t_last - t_first) / (completion_tokens - first chunk's tokens), and tokens/s
is its inverse. Requests are grouped by the ``x-tiergate-tier`` response header (by model when the server is not
Tiergate). Cost comes from the gateway's ``/metrics`` (``tiergate_cost_usd_total``, before and after the run;
other traffic at the same time is counted too) when it is reachable.

The client is aiohttp (a runtime dependency), so the command works from a plain install; every loop is bounded
by ``--requests`` and every request by ``--timeout``. The chart is one self-contained HTML file: inline SVG, no
scripts.

Its modules: ``mix`` (what is sent), ``client`` (sending and timing), ``figures`` (per tier), ``chart`` (the HTML),
``command`` (``tiergate bench``); this face re-exports what the command line, the agent loop and the tests use.
"""

from __future__ import annotations

from gateway.tools.loadtest.client import Result, run, send
from gateway.tools.loadtest.command import main
from gateway.tools.loadtest.figures import TierStats, percentile, summary
from gateway.tools.loadtest.mix import parse_mix, plan

__all__ = ["Result", "TierStats", "main", "parse_mix", "percentile", "plan", "run", "send", "summary"]
