"""Device-resident splits (docs/design.md §2b): E3's constant split form inside one process on the execution device.

* :mod:`~e3.serving.device.executor`: one split (blocks first..last with their ramps) as a captured graph per
  batch bucket on CUDA, or eagerly on the CPU; one interface, chosen by what is installed.
* :mod:`~e3.serving.device.dispatch`: when a split's queue runs (E3 §4), pure.
* :mod:`~e3.serving.device.pipeline`: the queues of cut states as device tensors, the exit test with one host
  sync per split execution, survivors handed on by an on-device gather; and the baselines in the same engine
  (the stock model, the naive early-exit model compacting on the device).
* :mod:`~e3.serving.device.router`: ``<m>_router``'s entry for every plan (the device router for a plan of
  device splits, else the CPU router).
* :mod:`~e3.serving.device.continuous`: continuous answering (``execute`` admits, one engine thread computes and
  answers), shared with E²bird's stage (:mod:`e3.serving.ebird`).
* :mod:`~e3.serving.device.timing`: the executor timed as it serves (``e3 profile --cuda``).
* :mod:`~e3.serving.device.hops`: a split boundary priced inside Triton (BLS with device tensors, host round
  trip, device hand-off).
* :mod:`~e3.serving.device.triton_model`: the Triton Python-backend model of the GPU side-by-side (E3's device
  router and the two baselines).
"""
