"""The benchmark room (`e3.benchmarks`): every `e3 bench ...` driver, its pure report parts and the one
section writer for ``docs/RESULTS.md``. It may import every other room; nothing below it imports it. Scripts that
are not part of `e3 bench` stay runnable as ``python benchmarks/<x>.py``.

The CPU side-by-side: side_by_side.py (the harness: start a server, calibrate the baselines, drive load, write a
section; each other bench reuses its pieces), side_by_side_report.py and report.py (the pure parts, the one
section writer), sim_validation.py (the simulator against the measured cells), perf_check.py (perf_analyzer
against the load generator), machine_speed.py (`e3 bench machine-speed`: the machine's fast and slow spells), repeatability.py (`e3 bench
repeatability`: two runs against each other with the simulator's bar),
constant_batches.py, batch_histogram.py, split_queue_policy.py, planning_time.py,
forecast_error.py.

GPUs: gpu_host.py (the standing GPU run, everything a lent GPU runs in one go), gpu_side_by_side.py with
gpu_in_process.py, gpu_sweep.py, gpu_load.py and gpu_side_by_side_report.py (E3 against the baselines through
Triton on one GPU), threaded_answer_probe.py with threaded_answer_model.py (does answering from a thread survive load there, and
its models), gpu_sim.py and
gpu_clusters.py (`e3 bench gpu`: clusters by simulation).

E²bird: admission.py with admission_report.py (the CPU stage), admission_gpu.py (the analogues in one process on
a GPU), admission_triton.py with admission_triton_report.py (the stage through Triton on a GPU),
admission_engine_cost.py (the serving loop's host cost).

Generation: generation.py (speed and quality), generation_frontier.py (the speed/quality frontier),
generation_gpu.py (the modes with the KV cache on a GPU), helios.py, exegpt.py.

The front door and reliability: front_door.py (the guards against Triton's own ports), reliability.py
(``make reliability``).
"""
