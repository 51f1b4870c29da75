"""`make reliability`: the long reliability runs, one line per item of the reliability issue with its figure.

Runs the reliability tests with their long settings (E3_RELIABILITY=1, 5,000 fuzzed HTTP bodies, 1,000 fuzzed
gRPC messages, a crash loop of
10 kills, a soak of 1,000,000 requests: about 25-30 minutes of the run on the 2-core machine), one pytest run at a time (each
starts its own tritonserver), reads the figures the tests print, and prints:

    item 1  no request takes the server down     PASS  5000 bodies, 0 deaths, ...
    ...

Items the project does not test yet are printed as NOT BUILT, never as passing. Exit status 1 if any
item that runs fails. Usage: ``python benchmarks/reliability.py [--bodies N] [--messages N] [--soak-requests N]
[--items 8,9]``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ISSUE_BODIES = 5000   # item 1's figure asks for at least this many fuzzed bodies (probes included)
ISSUE_MESSAGES = 1000   # item 15's: fuzzed gRPC messages
# What the tests of an item that prints no figure of its own check, said beside their count
CHECKS = {3: "NaN/Inf, token ids and masks out of range refused with 400 naming the input, row and range (router, "
             "<m>_ee, splits); over-long text truncated as documented; non-UTF-8 text refused"}

# (item, title, pytest selection, regexes whose matches in the output form the figure)
ITEMS = [
    (1, "no request takes the server down", ["tests/test_fuzz_http.py"], [r"fuzz: .*"]),
    (2, "supervision: tritonserver killed", ["tests/test_supervision.py"], [r"supervision: server killed.*"]),
    (3, "input policy (NaN/Inf, ids, text)", ["tests/test_input_policy.py"], []),
    (4, "instance resizing under 16-thread load", ["tests/test_reliability_resize.py"], [r"resize: .*"]),
    (5, "100 re-plans under load", ["tests/test_reliability_replans.py"], [r"replans: .*"]),
    (6, "kill -9 of a split's / the router's stub", ["tests/test_supervision.py"],
     [r"supervision: stub killed.*", r"supervision: router stub killed.*"]),
    (7, "a hung split", ["tests/test_hung_split.py", "tests/test_scheduler_watchdog.py"], [r"hung split: .*"]),
    (8, "backpressure at 3x capacity", ["tests/test_reliability_backpressure.py"],
     [r"backpressure: .*", r"queue policy: .*"]),
    (9, "soak: 1M requests, 100 reload cycles", ["tests/test_reliability_soak.py"], [r"soak: .*", r"reloads: .*"]),
    (10, "security: restricted APIs, names, SIGTERM",
     ["tests/test_security.py", "tests/test_e2e.py::test_e3_serve_stops_cleanly_on_sigterm"],
     [r"security: (?!e3 serve).*"]),
    (11, "one parse: duplicate keys, encodings, types", ["tests/test_front_door.py"], [r"front door: one parse.*"]),
    (12, "no way around: absolute-form, direct port", ["tests/test_front_door.py"], [r"front door: no way.*"]),
    (13, "crash loop: 10 kills in a minute", ["tests/test_supervision.py"],
     [r"crash loop: .*"]),
    (14, "slow/half-sent connections, deep shapes, big bodies", ["tests/test_front_door.py"],
     [r"front door: connections.*"]),
    (15, "gRPC through its guard: fuzz, size, the key", ["tests/test_fuzz_grpc.py"], [r"fuzz-grpc: .*"]),
    (16, "compressed bodies, half-closed clients", ["tests/test_front_door.py"],
     [r"front door: \d+ compressed.*", r"front door: \d+ of \d+ half-closed.*"]),
    (17, "no secret on /proc; 512 MiB gRPC; a 1 GiB bomb", ["tests/test_security.py"],
     [r"security: e3 serve: .*"]),
    (18, "the continuous device router: 100,000 requests from 64 clients",
     ["tests/test_device_continuous.py::test_continuous_router_answers_every_request_from_64_clients_as_the_reference"],
     [r"[\d,]+ requests from 64 clients in .*"]),
    (19, "E²bird's stage: 20,000 requests from 32 clients, each policy",
     ["tests/test_admission_e2e.py::test_requests_from_32_clients_answered_continuously_and_equal_to_the_model"],
     [r"admission: [\d,]+ requests from 32 clients.*"]),
    (20, "the zoo served split: 1,000 inputs a model from 16 clients",
     ["tests/test_zoo_e2e.py::test_inputs_from_sixteen_clients_equal_the_reference"], [r"zoo: [\d,]+ inputs .*"]),
    (21, "the GPU runners on this CPU: E3's side-by-side and E²bird's through Triton",
     ["tests/test_gpu_side_by_side.py::test_runner_cpu_mode_serves_every_system_and_writes_what_the_report_renders",
      "tests/test_admission_triton.py::test_runner_cpu_mode_serves_every_system_through_triton_and_writes_what_the_"
      "report_renders"], []),
]


def run(paths: list[str], env: dict) -> tuple[bool, str, float]:
    began = time.monotonic()
    existing = [p for p in paths if (ROOT / p.split("::")[0]).exists()]
    if not existing:
        return False, "no test file", 0.0
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *existing],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    return proc.returncode == 0, out, time.monotonic() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bodies", type=int, default=5000, help="fuzzed request bodies for item 1 (default 5000)")
    parser.add_argument("--messages", type=int, default=ISSUE_MESSAGES,
                        help="fuzzed gRPC messages for item 15 (default 1000)")
    parser.add_argument("--soak-requests", type=int, default=1_000_000,
                        help="requests of item 9's soak (default 1,000,000; fewer for a shorter run)")
    parser.add_argument("--items", default="",
                        help="comma-separated item numbers to run (default: all), e.g. --items 8,9")
    args = parser.parse_args()
    if args.bodies < 1 or args.soak_requests < 1:
        parser.error("--bodies and --soak-requests must be at least 1")
    known = {item for item, *_ in ITEMS}
    try:
        chosen = {int(i) for i in args.items.split(",") if i.strip()} or known
    except ValueError:
        parser.error(f"--items takes item numbers separated by commas (1-{max(known)}), got {args.items!r}")
    if chosen - known:
        parser.error(f"--items: no item {', '.join(map(str, sorted(chosen - known)))} (items are 1-{max(known)})")
    env = {**os.environ, "E3_RELIABILITY": "1", "E3_FUZZ_BODIES": str(args.bodies),
           "E3_FUZZ_MESSAGES": str(args.messages),
           "E3_SOAK_REQUESTS": str(args.soak_requests)}
    cache: dict[tuple[str, ...], tuple[bool, str, float]] = {}
    failed = 0
    for item, title, paths, patterns in ITEMS:
        if item not in chosen:
            continue
        if paths is None:
            print(f"item {item:<2} {title:<42} NOT BUILT", flush=True)
            continue
        key = tuple(paths)
        if key not in cache:
            if sys.stderr.isatty():   # items take minutes (the soak about 20): say which one is running
                print(f"item {item:<2} {title:<42} running ...", end="\r", file=sys.stderr, flush=True)
            cache[key] = run(paths, env)
        ok, out, seconds = cache[key]
        figures = [m.group(0).strip() for p in patterns for m in re.finditer(p, out)]
        summary = re.findall(r"\d+ (?:passed|failed)[^\n=]*", out)
        figure = "; ".join(figures) if figures else (summary[-1].strip() if summary else "(no pytest summary)")
        if not figures and item in CHECKS:
            figure = f"{figure}: {CHECKS[item]}"
        if item == 1:   # a death fails the test (every later body would fail, and it checks the server at the end)
            figure += "; 0 server deaths" if ok else ""
            if args.bodies < ISSUE_BODIES:
                figure += f" (fewer bodies than the {ISSUE_BODIES:,} the issue asks for: --bodies)"
        if item == 15 and args.messages < ISSUE_MESSAGES:
            figure += f" (fewer messages than the {ISSUE_MESSAGES:,} the issue asks for: --messages)"
        failed += not ok
        print(f"item {item:<2} {title:<42} {'PASS' if ok else 'FAIL'}  {figure}  ({seconds:.0f} s)", flush=True)
        if not ok:
            print("\n".join("    " + l for l in out.strip().splitlines()[-25:]), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
