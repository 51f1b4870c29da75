"""ExeGPT (ASPLOS '24) for the served decoder: latency-bounded scheduling of generation.

Pure modules (no torch, no Triton), in the order a plan is made (``docs/exegpt.md``):

* ``workload``  — the per-layer latency profile (prefill by tokens, decode by batch) and output-length
  distributions;
* ``simulator`` — predicted throughput and p99-length latency of RRA and WAA schedules;
* ``search``    — the control variables, branch-and-bound over them and the exhaustive grid it is checked
  against.
* ``scheduler`` — the decisions of the Triton front door ``<m>_generate_exegpt`` (``generation/exegpt/router.py``):
  RRA or WAA by branch-and-bound, RRA's phases around the engine, WAA's hand-overs, the served profiles from
  its timed steps, re-planning on a length shift.

Beside them: ``waa`` (WAA's encode worker beside a decode engine), ``door`` (the door's export), ``drive``
(client-side load and control; ``e3 bench exegpt`` lives in ``benchmarks/exegpt.py``), ``profiler``, ``validate``, ``report``, ``cli``.
"""
