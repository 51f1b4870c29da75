"""Names of the router's custom metrics on Triton's metrics port (DESIGN §2).

The router exports these with ``pb_utils.MetricFamily``; the controller
reads them from ``http://<host>:<metrics port>/metrics`` (Prometheus text
format) and nothing else. Every metric carries the label ``model`` (the
served model name ``<m>``); per-ramp metrics also carry ``ramp`` (the block
number k; the head is ramp L).

| metric | kind | meaning |
| --- | --- | --- |
| e3_inputs_total | counter | inputs that entered the router (block 1) |
| e3_batches_total | counter | batches the router executed (one per router execute call) |
| e3_ramp_reached_total | counter | inputs that reached ramp k (were still running after block k) |
| e3_ramp_exited_total | counter | inputs answered at ramp k |
| e3_dropped_total | counter | inputs dropped with an error (label ``reason``: ``deadline``, ``error``) |
| e3_queue_delay_us_total | counter | summed time inputs waited before their batch entered split 1 (us) |
| e3_plan_info | gauge | 1 for the plan in force (label ``plan_id``) |
"""

INPUTS = "e3_inputs_total"
BATCHES = "e3_batches_total"
RAMP_REACHED = "e3_ramp_reached_total"
RAMP_EXITED = "e3_ramp_exited_total"
DROPPED = "e3_dropped_total"
QUEUE_DELAY_US = "e3_queue_delay_us_total"
PLAN_INFO = "e3_plan_info"

__all__ = ["INPUTS", "BATCHES", "RAMP_REACHED", "RAMP_EXITED", "DROPPED", "QUEUE_DELAY_US", "PLAN_INFO"]
