"""`e3` verbs of early-exit generation: export-generate, export-helios, plan-generate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from e3.paths import default_repository

# Deferred imports: `e3 --help` and the light verbs must start fast, without torch or the generation rooms, so each
# verb imports what it needs inside its function.


def _export_generate(args) -> int:
    from e3.generation.repository import export_generation_repository
    repo = Path(args.repo) if args.repo else default_repository()
    try:
        spec = export_generation_repository(args.model, repo, max_active=args.max_active,
                                            calibrate=False if args.no_calibrate else None,
                                            calibration_prompts=args.calibration_prompts)
    except (ValueError, FileNotFoundError) as err:
        print(f"e3 export-generate: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {spec.model}_split_* / _kvfill_* / _generate{{,_naive,_stream}} to {repo}")
    _print_heads(args.model)
    if spec.calibration:
        print("CALM calibrated to (docs/generation.md):")
    for t in (spec.calibration or {}).get("targets", []):
        how = ("no exits (they do not pay: plain decoding)" if t["fallback"] else
               f"{t['measure']} >= {', '.join(f'{x:.3f}' for x in t['thresholds'])}")
        print(f"  min_agreement {t['min_agreement']:.2f}: {how}; agreement decoded on the calibration prompts "
              f"{t['predicted_agreement']:.3f}, predicted speed-up {t['predicted_speedup']:.3f}x")
    return 0


def _print_heads(model: str) -> None:
    """The exit heads' training report (whole-vocabulary agreement on held-out text, per exit layer)."""
    import torch

    from e3.generation.models import heads_path
    path = heads_path(model)
    if not path.exists():
        return
    summary = json.loads(torch.load(path, weights_only=True)["summary"])
    print(f"exit heads ({summary.get('counted', '')}; {summary.get('heldout_positions')} positions; trained in "
          f"{summary.get('train_s', 0):.0f} s):")
    for e, r in summary.get("exits", {}).items():
        general = (f"; general prompts (held-out topics) trained {r['general_top1']:.3f}, untrained "
                   f"{r['general_top1_untrained']:.3f}" if "general_top1" in r else "")
        print(f"  after layer {e}: trained {r['top1_agreement_full_vocab']:.3f}, untrained "
              f"{r['top1_agreement_full_vocab_untrained']:.3f}, classifier AUC {r['classifier_auc']:.3f}{general}")


def _export_helios(args) -> int:
    from e3.generation.repository import export_helios_repository
    repo = Path(args.repo) if args.repo else default_repository()
    try:
        doors = export_helios_repository(args.models, repo, memory_mb=args.memory_mb, tau=args.tau,
                                         eval_prompts=args.eval_prompts, ri=args.ri, cbc_max=args.cbc_max,
                                         window=args.window, switch_gain=args.switch_gain)
    except (ValueError, FileNotFoundError) as err:
        print(f"e3 export-helios: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote the candidates' split models and {', '.join(doors)} to {repo}; serve the front doors only "
          f"(e3 serve --models {doors[0]}): HELIOS loads the split models it needs itself")
    return 0


def _plan_generate(args) -> int:
    from e3.generation.exegpt.cli import run
    return run(args)


def add_export_generate(sub, repo_help: str) -> None:
    """`e3 export-generate`'s arguments."""
    eg = sub.add_parser("export-generate", help="write an early-exit generation model (split models, kv-fill models, "
                                                "generation routers) into the model repository")
    eg.add_argument("model", nargs="?", default="smollm2-ee", help="smollm2-ee (default) or tiny-gen")
    eg.add_argument("--repo", default=None, help="model repository (default model_repository/)")
    eg.add_argument("--max-active", type=int, default=16, help="sequences decoded together by <m>_generate (default 16)")
    eg.add_argument("--calibration-prompts", type=int, default=64,
                    help="held-out prompts CALM's exits are calibrated on per min_agreement target (default 64)")
    eg.add_argument("--no-calibrate", action="store_true",
                    help="skip profiling and calibration (requests must then give tau, not min_agreement)")
    eg.set_defaults(func=_export_generate)


def add_export_helios(sub, repo_help: str) -> None:
    """`e3 export-helios`'s arguments."""
    eh = sub.add_parser("export-helios", help="HELIOS: write early-exit LLM candidates (split models) and the "
                                              "helios_generate front door that chooses among them")
    eh.add_argument("models", nargs="+", help="candidates sharing a tokenizer, e.g. smollm2-ee smollm2-ee-late")
    eh.add_argument("--repo", default=None, help="model repository (default model_repository/)")
    eh.add_argument("--memory-mb", type=float, default=560.0, help="budget for loaded weights + reserved KV (MiB, "
                                                                  "default 560)")
    eh.add_argument("--tau", type=float, default=0.9, help="confidence threshold (softmax margin, default 0.9)")
    eh.add_argument("--eval-prompts", type=int, default=5, help="Step 2: prompts per candidate (default 5)")
    eh.add_argument("--ri", type=int, default=150, help="re-assessment interval in prompts (default 150)")
    eh.add_argument("--cbc-max", type=int, default=50, help="breaches tolerated ... (default 50)")
    eh.add_argument("--window", type=int, default=100, help="... in this many tokens (default 100)")
    eh.add_argument("--switch-gain", type=float, default=1.25, help="a switch must be predicted this much faster "
                                                                   "than loading the rest (default 1.25)")
    eh.set_defaults(func=_export_helios)


def add_plan_generate(sub, repo_help: str) -> None:
    """`e3 plan-generate`'s arguments."""
    pg = sub.add_parser("plan-generate", help="ExeGPT: profile the served decoder's layers, then the RRA/WAA "
                                               "schedule with the highest throughput per latency bound (B&B vs grid)")
    from e3.generation.exegpt.cli import add_arguments as _plan_generate_arguments
    _plan_generate_arguments(pg)
    pg.set_defaults(func=_plan_generate)
