"""Send the data file's inputs to a served model and compare every answer with the PyTorch reference run one
input at a time under the same rule and the plan's enabled ramps (e3.models.reference).

    python check_answers.py summit:summit_patience summit_patience_router --plan plan.json [--url 127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from e3.client.sdk import E3Client
from e3.core.exits import make_exit_rule
from e3.models.reference import reference_answers
from e3.models.user_data import load_data
from e3.models.zoo import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("served")
    ap.add_argument("--plan", default=None, help="the plan's enabled ramps (default: every ramp)")
    ap.add_argument("--data", default="summit_data.npz")
    ap.add_argument("--count", type=int, default=500)
    ap.add_argument("--url", default="127.0.0.1:8000")
    args = ap.parse_args()
    model = resolve_model(args.model)
    (x,), _ = load_data(args.data, model.card, limit=args.count)
    enabled = None
    if args.plan:
        enabled = tuple(k for s in json.load(open(args.plan))["splits"] for k in s["enabled_ramps"])
    ref = reference_answers(model, (x,), make_exit_rule(model.card.exit_rule), enabled_ramps=enabled)
    with E3Client(args.url) as client:
        got = [client.infer(args.served, {"x": x[i:i + 16]}) for i in range(0, len(x), 16)]
    label, ramp = np.concatenate([g.label for g in got]), np.concatenate([g.exit_ramp for g in got])
    probs = np.concatenate([g.probs for g in got])
    clear = ref.min_margin > 1e-5
    same = clear & (label == ref.label) & (ramp == ref.exit_ramp) & np.all(np.abs(probs - ref.probs) <= 1e-5, axis=1)
    print(f"{args.served}: {int(same.sum())} of {int(clear.sum())} answers equal the PyTorch reference (label, exit "
          f"ramp, probabilities; enabled ramps {list(enabled) if enabled is not None else 'all'}; "
          f"{int((~clear).sum())} in the tie band left out); exits {np.bincount(ramp, minlength=6)[1:].tolist()}")


if __name__ == "__main__":
    main()
