"""The shared vocabulary every room imports (and that imports nothing of ours, and nothing heavy):
names, model cards and the dtype map, plans, exit rules, latency and batch profiles, E3's cost model,
telemetry names and the Prometheus parser, the repository manifest, atomic files, per-request rows.
docs/architecture.md lists each module's job."""
