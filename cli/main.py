"""The `e3` command line: one verb per job, no logic of its own.

e3 export MODEL --cuts 2      write a Triton model repository (splits, router, baselines)
e3 serve                      run tritonserver on that repository until Ctrl-C
e3 infer MODEL                send a few inputs, print prediction, exit ramp, latency
e3 profile MODEL              measure (or --modelled GPU: model) per-block latency and Tx
e3 train MODEL                train a zoo model (checkpoints under artifacts/)
e3 evaluate MODEL             accuracy/exits vs threshold, compute saved vs stock (table + PNG)
e3 workload MODEL             easy/hard workload mixes and a switching stream
e3 plan                       plan cuts, instances, devices, input batch (E3's DP) under an SLO
e3 demo                       export + serve + side-by-side load + table
e3 bench side-by-side         E3 vs <m>_stock and <m>_ee at equal cores, per mix and request size
e3 bench simulator            the discrete-event simulator against the side-by-side's real runs
e3 bench gpu                  GPU clusters by simulation (MODELLED profiles): goodput vs batch, cost
e3 bench admission            E²bird's elastic admission vs Triton's dynamic batcher under a QoS target
e3 bench generate             early-exit generation (SmolLM2): speed and quality vs the full model
e3 export-generate MODEL      write a generation model's splits and routers into the model repository
e3 export-helios MODELS...    HELIOS over early-exit LLM candidates: their splits and helios_generate
e3 bench helios               HELIOS against each candidate alone, under one memory budget
e3 plan-generate [MODEL]      ExeGPT: profile the decoder, schedule under latency bounds (B&B vs grid)
e3 bench exegpt               ExeGPT's RRA/WAA on Triton: the schedule per latency bound, vs static and continuous
e3 admission MODEL --qos-ms Q add an elastic admission stage (N-Ebird / E-Ebird) in front of MODEL
e3 load SERVED_MODEL          closed/open-loop load or a workload replay; goodput under an SLO
e3 control --model M ...      every window: telemetry -> forecast -> plan -> apply to a running Triton
e3 status --model M           live plan, loaded splits, forecast vs observed, plan history
e3 perf -- -m MODEL ...       run perf_analyzer with its libraries found
e3 models                     list the model zoo
e3 clean                      remove generated artifacts
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from e3.cli import bench
from e3.cli import control
from e3.cli import generate
from e3.cli import models
from e3.cli import serve

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="e3", description="E3 on Triton: serve early-exit models split, "
                                "re-batched and planned, on NVIDIA Triton Inference Server.")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    repo_help = "model repository (default: ./model_repository)"

    models.add_export(sub, repo_help)
    models.add_profile(sub, repo_help)
    serve.add_serve(sub, repo_help)
    serve.add_infer(sub, repo_help)
    models.add_plan(sub, repo_help)
    serve.add_demo(sub, repo_help)
    models.add_admission(sub, repo_help)
    bench.add_bench(sub, repo_help)
    serve.add_perf(sub, repo_help)
    models.add_train(sub, repo_help)
    models.add_evaluate(sub, repo_help)
    models.add_workload(sub, repo_help)
    serve.add_load(sub, repo_help)
    control.add_control(sub, repo_help)
    control.add_status(sub, repo_help)
    generate.add_export_generate(sub, repo_help)
    generate.add_export_helios(sub, repo_help)
    generate.add_plan_generate(sub, repo_help)
    models.add_models(sub, repo_help)
    models.add_clean(sub, repo_help)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # `package.module:factory` names a module in the working directory as `python -m` would find it
    # (a console script's sys.path starts at its own folder, not the working directory)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except Exception as err:
        if not isinstance(err, _user_errors()):
            raise
        print(f"e3 {args.command}: error: {err}", file=sys.stderr)
        return 2


# Errors a user fixes (printed as one line, exit 2), by module: a module the command never imported cannot
# have raised its error, and importing e3.export here would load torch into every command (the controller
# needs neither torch nor the model's checkpoint).
USER_ERRORS = {"e3.deploy.server": "ServerError", "e3.client.sdk": "ClientError",
               "e3.export.repository": "ExportError", "e3.models.checkpoints": "CheckpointMissing"}


def _user_errors() -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = [ValueError]
    for module, name in USER_ERRORS.items():
        if module in sys.modules:
            found.append(getattr(sys.modules[module], name))
    return tuple(found)
