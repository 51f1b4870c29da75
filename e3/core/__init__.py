"""The shared vocabulary every room imports (and that imports nothing of ours, and nothing heavy):

names.py      names shared by every part: served models, splits, systems (the one registry of system names)
spec.py       what crosses a boundary about a model: tensor specs, the model card, the dtype map
plan.py       the plan: how a model is cut, batched and spread over instances
exits.py      exit rules: when an input leaves at a ramp (pure numpy)
profile.py    latency profiles and batch profiles: the planner's two inputs
cost.py       E3's cost model: what a plan costs, from the two profiles
telemetry.py  the router's custom metric names and the Prometheus text parser
manifest.py   the model repository's manifest (what e3 wrote into a repository)
files.py      atomic file writes: a reader never sees half a file
rows.py       rows of a concatenated batch, per request
session.py    the one way a split's ONNX file is opened in ONNX Runtime
closing.py    a tritonclient connection that is its own context manager
"""
