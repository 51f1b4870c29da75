"""The benchmark room (`e3.benchmarks`): every `e3 bench ...` driver, its pure report parts and the one
section writer for ``docs/RESULTS.md`` (:mod:`e3.benchmarks.report`).

The harness (start a server, calibrate the baselines, drive load, write a section) is
:mod:`e3.benchmarks.side_by_side`; each other bench reuses its pieces. The scripts here that are not part of
`e3 bench` (``reliability.py``, ``batch_histogram.py``, ...) stay runnable as ``python benchmarks/<x>.py``.
This room may import every other room; nothing below it imports it.
"""
