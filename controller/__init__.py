"""Control plane: exit forecaster (ARIMA), planner (E3's DP) and the control loop that applies plans to Triton.

One job per module:

telemetry.py          router counters on Triton's metrics port -> one window's measured batch profile
forecast.py           forecasts of the next window's batch profile (ARIMA, last value), their error, drift
planner/              E3's dynamic program: cuts, instances, device configurations, input batch, placement on pools (pure)
settings.py           what the controller is asked to do (ControlSettings), validated once; where its files go
decisions.py          apply a plan or not, score a running plan, diff two plans, retry backoff (pure)
health.py             straggling splits and failed requests, from Triton's counters (pure; dead stubs: deploy/stubs.py)
history.py            every applied plan, validated, in one atomically replaced JSON file
applier.py            the controller's contract with a server: ServerView (reads), ServerControl (changes)
triton_applier.py     ServerView and ServerControl on a running Triton (HTTP API, metrics port)
recording_applier.py  ServerView and ServerControl held in memory, recording every call (tests)
pooled_applier.py     ServerView and ServerControl over several Tritons (pools); plans placed on the pools
k8s_scaler.py         pods of a pool's Deployment through the Kubernetes API, or read-only when an autoscaler owns them
model_facts.py        the served model's blocks, ramps and exit rule from a manifest or a plan, never a checkpoint (pure)
signals.py            the rate to plan for (observed traffic above a floor) and each pool's desired pods (pure)
metrics.py            the controller's Prometheus metrics (desired replicas, drop rate) and its probes
triton_api.py         Triton's model-repository calls: load, unload, configs, statistics, router plan switch
loop.py               the control loop: telemetry -> forecast -> plan -> decide -> apply, every window
report.py             text for people: plans, planner results, window reports, status (`e3 plan/control/status`)
"""
