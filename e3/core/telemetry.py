"""Names of the router's custom metrics on Triton's metrics port (docs/design.md §2).

The router exports these with ``pb_utils.MetricFamily``; the controller
reads them from ``http://<host>:<metrics port>/metrics`` (Prometheus text
format) and nothing else. Every metric carries the label ``model`` (the
served model name ``<m>``); per-ramp metrics also carry ``ramp`` (the block
number k; the head is ramp L).

| metric | kind | meaning |
| --- | --- | --- |
| e3_inputs_total | counter | inputs that entered split 1 |
| e3_batches_total | counter | input batches: batches the router dispatched to split 1 |
| e3_ramp_reached_total | counter | inputs not yet answered when they reached ramp k (enabled ramps and the head) |
| e3_ramp_exited_total | counter | inputs answered at ramp k |
| e3_dropped_total | counter | inputs answered with an error (label ``reason``: ``deadline`` or ``error``) |
| e3_rejected_total | counter | requests refused at admission by the router's ``max_queue_inputs`` (never admitted: not in e3_inputs_total) |
| e3_rejected_inputs_total | counter | the inputs of those requests |
| e3_router_overhead_us_total | counter | the router's own Python work (gathering, exit decisions, slicing, responses): CPU time of its thread outside BLS calls, microseconds |
| e3_router_bls_us_total | counter | time the router spent waiting on BLS calls to splits (queueing + compute + Tx), microseconds |
| e3_plan_info | gauge | 1 for the plan in force (label ``plan_id``) |

The router sums its counts locally and a background thread hands them to
Triton every 0.2 s (also after traffic stops), so a scrape may lag by that much.

Queueing delay before the router and inside each split is Triton's own
``nv_inference_queue_duration_us`` per model; executed batch sizes per split
are in Triton's per-model statistics (``batch_stats``).
"""

from __future__ import annotations

from typing import Iterator

INPUTS = "e3_inputs_total"
BATCHES = "e3_batches_total"
RAMP_REACHED = "e3_ramp_reached_total"
RAMP_EXITED = "e3_ramp_exited_total"
DROPPED = "e3_dropped_total"
REJECTED = "e3_rejected_total"
REJECTED_INPUTS = "e3_rejected_inputs_total"
ROUTER_OVERHEAD_US = "e3_router_overhead_us_total"
ROUTER_BLS_US = "e3_router_bls_us_total"
PLAN_INFO = "e3_plan_info"

__all__ = ["metric_samples", "INPUTS", "BATCHES", "RAMP_REACHED", "RAMP_EXITED", "DROPPED", "REJECTED", "REJECTED_INPUTS",
           "ROUTER_OVERHEAD_US", "ROUTER_BLS_US", "PLAN_INFO"]


def metric_samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text page as ``(name, labels, value)``.

    Names lose the counter suffix ``_total`` (``e3_inputs_total`` -> ``e3_inputs``), as the
    Prometheus parser does for counter families, so callers match one spelling whatever the
    exporter declared. The one place the project parses Triton's metrics page.
    """
    from prometheus_client.parser import text_string_to_metric_families   # deferred: the floor stays light (150 ms)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name.removesuffix("_total"), dict(sample.labels), float(sample.value)
