"""A discrete-event simulator of the served system (SimPy): the real scheduler, the measured latency
profile, simulated time. Validated against real runs by `e3 bench` (docs/RESULTS.md)."""
