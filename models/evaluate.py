"""`e3 evaluate MODEL`: accuracy and exits against the exit threshold, compute saved vs stock.

For the model's test split: every ramp's logits are computed once, then the
exit rule is replayed for a grid of thresholds (τ for entropy rules, patience
for PABEE) with the same policy code the router runs. Compute is counted in
blocks executed (ramps are a pooler and a linear layer: under 1% of a block's
FLOPs for MiniLM, ignored and said so). The analogue of E3 Fig. 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from e3.core.exits import EntropyRule, PatienceRule, make_exit_rule
from e3.core.files import atomic_path, write_json_atomic
from e3.core.names import served_name
from e3.models.data import split_inputs
from e3.models.training import all_exit_logits, simulate_exits, summarize_exits
from e3.models.user_data import load_data
from e3.models.zoo import ZOO, resolve_model, resolve_stock

__all__ = ["Evaluation", "evaluate", "format_evaluation", "plot_evaluation", "evaluation_figure"]


@dataclass
class Evaluation:
    model: str
    num_blocks: int
    rule: dict                          # the default exit rule
    at_default: dict                    # accuracy, exit_share, blocks_fraction at the default rule
    stock_accuracy: float | None        # the stock model's test accuracy (None if no stock model)
    final_ramp_accuracy: float          # the EE model's head alone
    sweep: list[dict] = field(default_factory=list)  # one row per threshold: threshold, accuracy, blocks_fraction, exit_share

    @property
    def compute_saved(self) -> float:
        return 1.0 - self.at_default["blocks_fraction"]

    @property
    def accuracy_drop_points(self) -> float | None:
        if self.stock_accuracy is None:
            return None
        return 100.0 * (self.stock_accuracy - self.at_default["accuracy"])

    def to_dict(self) -> dict:
        return {"model": self.model, "num_blocks": self.num_blocks, "rule": self.rule, "at_default": self.at_default,
                "stock_accuracy": self.stock_accuracy, "final_ramp_accuracy": self.final_ramp_accuracy,
                "compute_saved": self.compute_saved, "accuracy_drop_points": self.accuracy_drop_points,
                "sweep": self.sweep}


def test_split_logits(name: str, progress: bool = True, limit: int | None = None, *, desc: str = "evaluate",
                      data: str | Path | None = None):
    """Model ``name``, its test inputs and labels, and every exit's logits on them (``limit``: first N inputs
    only). ``data``: a ``.npz`` file of inputs and labels (:mod:`e3.models.user_data`), for any model; else
    the zoo model's test split."""
    entry = ZOO.get(name)
    if data is None and (entry is None or entry.dataset is None):
        raise ValueError(f"{name!r} has no dataset of its own; give your data with --data FILE (a .npz of the "
                         f"model's inputs and 'labels', docs in e3.models.user_data); zoo models with one: "
                         f"{', '.join(n for n, e in ZOO.items() if e.dataset)}")
    model = resolve_model(name)
    if data is not None:
        inputs, labels = load_data(data, model.card, limit=limit, need_labels=True)
        return model, inputs, labels, all_exit_logits(model, inputs, progress=progress, desc=f"{desc} {name}")
    inputs, labels = split_inputs(entry.dataset, "test", model.card.max_seq_len)
    if limit:
        inputs, labels = tuple(x[:limit] for x in inputs), labels[:limit]
    return model, inputs, labels, all_exit_logits(model, inputs, progress=progress, desc=f"{desc} {name}")


def evaluate(name: str, progress: bool = True, limit: int | None = None, *,
             data: str | Path | None = None) -> Evaluation:
    """Evaluate model ``name`` on its test split, or on ``data`` (a ``.npz`` of inputs and labels, any model;
    ``limit``: first N inputs only). A rule other than entropy or patience is evaluated as it is, without a
    sweep (its parameters are its own)."""
    model, inputs, labels, logits = test_split_logits(name, progress, limit, data=data)
    entry = ZOO.get(name)
    card = model.card
    L = card.num_blocks
    rule = card.exit_rule
    at_default = summarize_exits(simulate_exits(logits, make_exit_rule(rule), L), labels, L)
    if rule["kind"] == "entropy":
        taus = sorted({*np.round(np.linspace(0, math.log(card.num_classes), 21), 4), rule["tau_nats"]})
        grid = [("tau_nats", float(t), EntropyRule(float(t))) for t in taus]
    elif rule["kind"] == "patience":
        grid = [("patience", p, PatienceRule(p)) for p in range(1, L)]
    else:
        grid = []
    sweep = []
    for key, value, r in grid:
        s = summarize_exits(simulate_exits(logits, r, L), labels, L)
        sweep.append({key: value, **s})
    stock_acc = None
    if entry is not None and entry.build_stock is not None:
        stock = resolve_stock(name)
        stock_logits = all_exit_logits(stock, inputs, progress=progress, desc="evaluate stock")
        stock_acc = float((stock_logits[stock.card.num_blocks].argmax(1) == labels).mean())
    return Evaluation(name, L, rule, dict(at_default), stock_acc,
                      float((logits[L].argmax(1) == labels).mean()), sweep)


def _sweep_key(rule: dict) -> str | None:
    return {"entropy": "tau_nats", "patience": "patience"}.get(rule["kind"])


def format_evaluation(ev: Evaluation) -> str:
    key = _sweep_key(ev.rule) or "-"
    blocks = range(1, ev.num_blocks + 1)
    lines = [f"{ev.model}: default exit rule {ev.rule}"]
    header = f"{key:>9}  {'accuracy':>8}  {'blocks run':>10}  " + "  ".join(f"exit@{k:<2}" for k in blocks)
    if ev.sweep:
        lines += [header, "-" * len(header)]
    for row in ev.sweep:
        shares = "  ".join(f"{100 * row['exit_share'].get(k, 0):6.1f}%" for k in blocks)
        mark = " <- default" if row[key] == ev.rule.get(key) else ""
        lines.append(f"{row[key]:>9.3f}  {100 * row['accuracy']:7.2f}%  {100 * row['blocks_fraction']:9.1f}%  "
                     f"{shares}{mark}")
    d = ev.at_default
    lines += ["", "at the default rule:",
              "  exit share per ramp: " + ", ".join(f"{k}: {100 * d['exit_share'].get(k, 0):.1f}%" for k in blocks),
              f"  average fraction of blocks executed: {100 * d['blocks_fraction']:.1f}% "
              f"(compute saved {100 * ev.compute_saved:.1f}%; ramps' own cost ignored)",
              f"  accuracy {100 * d['accuracy']:.2f}%; final ramp alone {100 * ev.final_ramp_accuracy:.2f}%"]
    if ev.stock_accuracy is not None:
        lines.append(f"  stock model {100 * ev.stock_accuracy:.2f}%: accuracy drop {ev.accuracy_drop_points:+.2f} points")
    return "\n".join(lines)


def plot_evaluation(ev: Evaluation, path: Path) -> Path:
    """PNG: accuracy and compute saved against the threshold; exit shares at the default."""
    fig = evaluation_figure(ev)          # chooses the Agg backend before pyplot loads
    import matplotlib.pyplot as plt     # deferred: only a plot loads matplotlib, after the backend is chosen
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return path


def evaluation_figure(ev: Evaluation):
    """The figure :func:`plot_evaluation` saves. Left: accuracy and compute saved against the threshold (τ or
    patience); a rule of your own has no threshold to sweep (its parameters are its own), so the left panel
    shows the same quantities at that rule as bars, and says so, instead of empty axes."""
    # deferred: only a plot loads matplotlib, and pyplot only after the Agg backend is chosen
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # deferred: after the backend is chosen
    key = _sweep_key(ev.rule)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    if ev.sweep:
        xs = [r[key] for r in ev.sweep]
        a.plot(xs, [100 * r["accuracy"] for r in ev.sweep], "o-", label="EE accuracy")
        a.plot(xs, [100 * (1 - r["blocks_fraction"]) for r in ev.sweep], "s-", label="compute saved")
        if ev.stock_accuracy is not None:
            a.axhline(100 * ev.stock_accuracy, color="gray", ls="--", label="stock accuracy")
        a.axvline(ev.rule[key], color="red", ls=":", label=f"default {key}")
        a.set_xlabel({"tau_nats": "τ (nats)", "patience": "patience"}[key])
        a.set_title(f"{ev.model}: accuracy and compute saved")
        a.legend(fontsize=8)
    else:
        bars = {"EE accuracy": ev.at_default["accuracy"], "compute saved": ev.compute_saved,
                "head alone": ev.final_ramp_accuracy}
        if ev.stock_accuracy is not None:
            bars["stock accuracy"] = ev.stock_accuracy
        a.bar(list(bars), [100 * v for v in bars.values()], color=["C0", "C1", "C2", "gray"][:len(bars)])
        for i, v in enumerate(bars.values()):
            a.text(i, 100 * v, f"{100 * v:.1f}%", ha="center", va="bottom", fontsize=8)
        a.set_xlabel(f"at the rule {ev.rule['kind']} (its own parameters: no threshold to sweep)")
        a.set_title(f"{ev.model}: accuracy and compute saved at its rule")
    a.set_ylabel("%")
    blocks = list(range(1, ev.num_blocks + 1))
    b.bar(blocks, [100 * ev.at_default["exit_share"].get(k, 0) for k in blocks])
    b.set_xlabel("exit ramp (block; last = final head)")
    b.set_ylabel("% of test inputs")
    b.set_title("exit distribution at the default rule")
    fig.tight_layout()
    return fig


def save_evaluation(ev: Evaluation, folder: Path) -> tuple[Path, Path]:
    stem = served_name(ev.model) if ":" in ev.model else ev.model
    js = write_json_atomic(folder / f"{stem}.evaluation.json", ev.to_dict(), indent=2, sort_keys=False,
                           default=float)
    return js, plot_evaluation(ev, folder / f"{stem}.evaluation.png")
