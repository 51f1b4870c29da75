"""E3's planner (E3 §3.2-3.2.3, Fig. 6): cuts, instances per split, device configurations and
input batch size, by dynamic programming. A pure function of its inputs: no I/O,
no Triton, no torch.

One job per module:

result.py   what a search returns (PlannerResult, its plan document) and the search's context
ramps.py    the exit-wrapper (E3 §3.4): which ramps are worth keeping at a B0
tables.py   the inputs checked, the B0 candidates, and one B0's table of every split's stage and hop
            in its better form (priced by E3's one cost model, :mod:`e3.core.cost`); which
            configurations may run the device form (:func:`~e3.controller.planner.tables.runs_device_form`)
dp.py       the dynamic programs over (blocks, devices used) and the backtrack to a plan
device.py   the device form's cuts on one accelerator (an exact DP of the added split loads)
search.py   the searches: best plan (fast, exact), cheapest plan, stock baseline; each weighs the best
            plan of constant and compact splits against the best all-device plan
placement.py  splits on device pools
reference.py  the original exact search, kept as the oracle the fast search must agree with (tests, timings)

The model of a plan
-------------------
A plan cuts blocks 1..L into splits. Split i covers blocks a..b, runs on one
device configuration c with m instances (the paper's replicas; instances of one
split share one configuration, §3.2.3). The formulas below are E3's cost
model, implemented once in :mod:`e3.core.cost`. Per *cycle* the front door admits one input batch of
B0 inputs; B_k = B0 * reach[k-1] of them reach block k (batch profile, with the
ramps the exit-wrapper keeps). Split i receives the B_a inputs that reach its
first block and each instance takes B_a / m of them (Fig. 6: "each GPU handles
B_k/m samples"). A split has a form (:mod:`e3.core.plan`):

* constant (its own Triton model):
  stage time   T_i  = sum_{k=a..b} P(k, c, B_a / m) + R(c, B_a / m)      (ms, enabled ramps included)
  hop into it  Tx_i = Tx(c, B_a / m); for the first split Tx_in(c, B_1 / m) (the model inputs)
* compact (the router runs the blocks, rows leave between blocks):
  stage time   T_i  = sum_{k=a..b} P(k, c, B_k / m) + sum_{enabled ramps k} check(c, B_k / m) + R(c, B_a / m)
  hop into it  Tx_i = 0
* device (docs/design.md §2b: a form of the whole plan, on one device of an accelerator, one instance per split,
  every split at the constant batch b = B0; survivors gathered across cycles until they fill b):
  stage time   T_i  = sum_{k=a..b} P(k, c, B0) + check(c, B0) + R(c, B0)   (one run)
  runs         n_i  = B_a / B0 = reach(a) per cycle;  hop Tx_i = 0
  the splits share the device, so their loads add: they are one pipeline stage of sum_i n_i T_i
* R: the router's own work per batch (stacking, exit rule, answers), part of the stage
* cycle time   C    = max_i max(T_i, Tx_i)  (pipelined, §3.2.2), or
                      sum_i (T_i + Tx_i)   (``pipelined=False``, §3.2.1)
* throughput        = 1000 * B0 / C                          (inputs/s)
* worst-case latency = 1000 * (B0 - 1) / R + sum_i (T_i + Tx_i)   (ms)
* cost              = sum_i m_i * price(c_i)

Constraints: latency <= SLO * (1 - slack); devices of each configuration <=
the devices; cost <= alpha * Cost_baseline (when alpha is given). Objective
of :func:`best_plan`: the highest throughput; ties go to the lower cost, then
the lower latency. :func:`cheapest_plan` answers the converse (E3 §5.3): the
lowest cost whose throughput reaches a given goodput (ties: higher throughput).

Decisions where the paper is silent or ambiguous
------------------------------------------------
* **Forms.** A Triton split cannot shrink a batch inside itself (docs/design.md §2:
  inputs that exit at an inner ramp keep computing to the split's end), so a
  constant split runs every block at B_a / m. Fig. 6 writes P(k, c, B_k/m),
  i.e. shrinking at every ramp: that is the compact form, which the router runs
  itself. Per candidate split (a, j, m, c) the planner keeps the form with the
  smaller stage time T (tie, within 1e-9: constant), records it and writes it
  into the plan; the hop does not enter that choice (it is its own pipeline
  stage). ``forms=("constant",)`` (``e3 plan --forms constant``) forces E3's form.
  What decides it is the profile: a CPU's latency grows with the batch (every
  exited row saved pays), an accelerator's barely does while every exit check
  costs a device-to-host sync (``check_ms``).
* **The device form** is weighed as a whole plan: for every accelerator configuration whose profile
  prices the exit check (:func:`~e3.controller.planner.tables.runs_device_form`) and every B0 up to the
  largest measured batch, the cuts (a subset of the ramps the exit-wrapper keeps on that configuration)
  with the least cycle sum_i n_i T_i whose latency (fill time + sum_i T_i) fits the budget; it costs one
  device. The best such plan is compared with the DP's best plan of constant and compact splits by
  throughput (ties: cost, latency; an exact tie goes to the DP's plan) and the result records both
  (``PlannerResult.compared``) with a note. A row waiting for a later device split's batch to fill is not
  charged to latency: the device's dispatch rule runs a partial batch as soon as nothing upstream can add
  rows (the device would be idle) and forces one before the SLO breaks (:mod:`e3.core.cost`).
* **Tx** is the hop *into* a constant split, taken at the receiving configuration and
  its per-instance batch (``LatencyProfile.tx(c, B_a/m)``): each instance
  receives its share in one call, instances receive in parallel. It is its own
  pipeline stage in the ``max`` (Fig. 6) and adds to latency. The first split
  pays it too when constant: the router sends it the model inputs by BLS
  (``tx_in_ms``, else ``tx_ms``). The hop out of the last split is left out.
* **The router's work** (``router_ms``, per batch of each split, at B_a / m)
  is part of every split's stage time, both for latency and for the cycle.
* **The stock baseline** is served without the router: no hop, no router work.
* **Worst-case latency** = batch fill time of the first input of a batch,
  (B0 - 1) / R, plus one pass through every stage and hop. With throughput
  >= R consecutive batches arrive at least one cycle apart, so no stage is
  busy when a batch reaches it (no queueing in the steady state); with
  throughput < R the front door drops the excess (E3 §3.1), same bound. The
  paper's "worst case latency is simply CycleTime" is the non-pipelined case
  without fill time.
* **B0** (input batch size) is chosen by the planner from powers of two up to
  ``max_batch * total devices`` (max_batch = the profile's largest measured
  batch) whose fill time alone fits the latency budget; the best one wins.
  ``b0s=`` overrides the set.
* **Instances.** m ranges over 1..min(N_c, ceil(B_a)): more instances than
  inputs reaching the split per cycle cannot shorten the stage (an instance's
  batch below 1 costs P(1), the profile's smallest batch; a higher rate is
  served by a larger B0). A per-instance batch above the largest measured batch
  is not allowed (the latency profile says nothing about memory there).
* **Cost_baseline** (see :func:`stock_baseline`): the cheapest *stock* plan
  (model without ramps, every input through every block, one split on one
  configuration with m instances, B0 from the same candidates) whose
  throughput reaches R within the latency budget. If no stock plan reaches R,
  the stock plan with the highest throughput sets it; if no stock plan meets
  the latency budget at all, the cost bound is dropped (logged).
* **Exit shares do not depend on B0** (independent exits): reach is the
  batch profile's, whatever B0 is chosen.
* **Ramps** (E3 §3.4's exit-wrapper, :mod:`~e3.controller.planner.ramps`, on by
  default, ``exit_wrapper=False`` to keep every ramp): for each B0 the wrapper
  disables the ramps whose cost (ramp + exit check at B_k) exceeds what their
  exits save; the inputs that would have exited there are assumed to exit at
  the next enabled ramp (reach recomputed), and the tables are priced with the
  ramps kept. With several configurations one set of ramps holds for the whole
  plan: a ramp is disabled only when every configuration disables it. The
  result lists every verdict; ``to_plan`` leaves disabled ramps out of the plan.

How it is solved
----------------
For each B0 the pipelined optimum is the smallest cycle bound t (one of the
finitely many stage/hop times) for which a plan exists with every stage and
hop <= t and latency, devices and cost within their bounds; feasibility is
monotone in t, so t is found by binary search. A cheap boolean DP (fewest
instances per split, which is enough when latency is ignored) finds the
smallest t that devices and cost allow; the latency DP below then checks
that t and, only if latency binds, the search continues upwards with it.
B0 values are visited in order of an upper bound on their throughput and
skipped once that bound cannot beat the best plan found.

That is the *reference* search; it lives in ``controller/planner/reference.py``, the
tests' oracle (and ``benchmarks/planning_time.py --reference``). :func:`best_plan`
(pipelined) runs a faster search for the same answer (:func:`search._search`); profiling showed
the time went to latency DPs on a B0 that loses (2.4 s of 2.8 s at 24 blocks,
64 devices, 3 configurations: the binary search starts at the most expensive
bound, the top one) and, with one configuration, to ~16 latency DPs per B0:

* **best-first over B0**: the B0 with the highest throughput upper bound gets
  the next step; tables are built only for B0s whose cheap bound
  (:func:`_cheap_cycle_bound`: least measured block time, plus the ramp's
  where every plan pays it) can still beat the best plan; a B0 is dropped
  once its lowest open bound exceeds the
  ``max_bound`` the best plan leaves it, as in the reference.
* **exact lower bounds first**: one configuration: the latency DP itself on
  the 1-D device grid as one gather per prefix over the (start, instances)
  pairs that fit the bound (:meth:`_B0Search._feasible_1d`), bisected to the
  smallest feasible bound; several configurations: the boolean DP (latency
  ignored), as before. Bisection splits geometrically while the candidates
  span > 1.5x (low bounds give cheap DPs).
* **racing probes**: then the full latency DP (the reference's own test,
  :func:`_latency_dp` + :func:`_best_cell`) is probed at the lowest open
  bound, then at the bound where this B0 would tie the runner-up's upper
  bound (an infeasible answer hands the work to the runner-up), then at the
  top, then by bisection.

Why it is still exact: every B0's answer is still the smallest candidate bound
(same candidate set, same ``max_bound``) at which the same latency DP finds a
cell within latency and cost; the extra tests only skip bounds they prove
infeasible (a 1-D DP that computes the same f values, the latency-free DP,
monotonicity in the bound) or B0s whose throughput bound cannot reach the best
plan; the plan itself comes from the same f, :func:`_best_cell` and
:func:`_backtrack`. ``tests/test_planner.py`` checks both searches against
brute force and the fast one against the reference on 30 random instances
(1-3 configurations, cost bounds); 330 such instances agreed plan for plan.
Non-pipelined planning (``pipelined=False``) solves each B0 with one latency DP
without a cycle bound (the cycle is the pipeline latency itself).
"""

from e3.controller.planner.ramps import RampVerdict, judge_ramps, ramps_worth_keeping
from e3.controller.planner.result import PlannerError, PlannerResult, PlanOptions, SearchContext
from e3.controller.planner.search import best_plan, cheapest_plan, stock_baseline
from e3.controller.planner.tables import b0_candidates, parse_devices, parse_forms

__all__ = ["PlannerError", "PlannerResult", "PlanOptions", "SearchContext", "best_plan", "cheapest_plan", "stock_baseline",
           "parse_devices", "parse_forms", "b0_candidates", "RampVerdict", "judge_ramps", "ramps_worth_keeping"]
