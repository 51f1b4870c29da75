"""Training and evaluation helpers shared by the zoo's recipes (see models/recipes.py).

Everything works from the :class:`EarlyExitModel` interface, so evaluation
and τ selection apply to any model; the encoder-specific parts (DeeBERT's
two stages) are marked as such.

CPU speed: training runs under bfloat16 autocast when the CPU supports it
(AMX / AVX512-BF16 kernels make it 2-3x faster here); every exported or
evaluated forward pass is fp32.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from e3.core.exits import EntropyRule, ExitRule, PatienceRule
from e3.models.api import EarlyExitModel
from e3.serving.policy import BatchRoute

__all__ = ["all_exit_logits", "simulate_exits", "choose_tau", "choose_patience", "finetune_head", "train_joint",
           "encoder_pooled_features", "train_ramps_on_pooled", "bf16_available", "ExitSummary", "summarize_exits"]

log = logging.getLogger(__name__)


def bf16_available() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@torch.no_grad()
def all_exit_logits(model: EarlyExitModel, inputs: tuple[np.ndarray, ...], batch_size: int = 128,
                    *, progress: bool = False, desc: str = "evaluate") -> dict[int, np.ndarray]:
    """Logits of every ramp and the head for every input: block -> [N, C] (fp32, eval mode)."""
    model.eval()
    n = len(inputs[0])
    out: dict[int, list[np.ndarray]] = {k: [] for k in model.card.exit_blocks}
    for start in tqdm(range(0, n, batch_size), desc=desc, unit="batch", disable=not progress, leave=False):
        state = model.stem(*(torch.as_tensor(x[start:start + batch_size]) for x in inputs))
        for k in range(1, model.card.num_blocks + 1):
            state = model.block(k, *state)
            if k in out:
                out[k].append(model.ramp(k, *state).numpy())
    return {k: np.concatenate(v) for k, v in out.items()}


def simulate_exits(logits: dict[int, np.ndarray], rule: ExitRule, num_blocks: int,
                   *, enabled: tuple[int, ...] | None = None) -> BatchRoute:
    """Apply ``rule`` to precomputed ramp logits exactly as the router would (one block per step)."""
    n, c = next(iter(logits.values())).shape
    route = BatchRoute(n, c, num_blocks, rule)
    for k in sorted(logits):
        if k != num_blocks and enabled is not None and k not in enabled:
            continue
        route.observe({k: logits[k][route.active]})
        if route.done:
            break
    return route


class ExitSummary(dict):
    """accuracy, share exiting per ramp, mean fraction of blocks executed."""


def summarize_exits(route: BatchRoute, labels: np.ndarray, num_blocks: int) -> ExitSummary:
    shares = {int(k): float((route.exit_ramp == k).mean()) for k in np.unique(route.exit_ramp)}
    return ExitSummary(accuracy=float((route.label == labels).mean()), exit_share=shares,
                       blocks_fraction=float(route.exit_ramp.mean() / num_blocks))


def choose_tau(dev_logits: dict[int, np.ndarray], labels: np.ndarray, num_blocks: int,
               *, max_drop: float = 0.015, reference_accuracy: float | None = None) -> tuple[float, ExitSummary]:
    """The largest τ (most compute saved) whose dev accuracy is within ``max_drop`` of the
    reference: the stock model's dev accuracy when given, else the EE model's own head.

    Decision: the budget (1.5 points by default) is under the issue's 2-point target,
    leaving room for dev/test variance; the stock model is the reference where it differs
    from the EE head (BranchyNet trains them apart). Candidates: 201 values from 0 to ln C.
    """
    head_acc = float((dev_logits[num_blocks].argmax(1) == labels).mean())
    if reference_accuracy is not None:
        head_acc = reference_accuracy
    c = dev_logits[num_blocks].shape[1]
    best = (0.0, summarize_exits(simulate_exits(dev_logits, EntropyRule(0.0), num_blocks), labels, num_blocks))
    for tau in np.linspace(0.0, math.log(c), 201)[1:]:
        s = summarize_exits(simulate_exits(dev_logits, EntropyRule(float(tau)), num_blocks), labels, num_blocks)
        if s["accuracy"] >= head_acc - max_drop:
            best = (round(float(tau), 5), s)
    return best


def choose_patience(dev_logits: dict[int, np.ndarray], labels: np.ndarray, num_blocks: int,
                    *, max_drop: float = 0.015) -> tuple[int, ExitSummary]:
    """The smallest patience (most compute saved) whose dev accuracy is within ``max_drop`` of the head's."""
    head_acc = float((dev_logits[num_blocks].argmax(1) == labels).mean())
    for patience in range(1, num_blocks):
        s = summarize_exits(simulate_exits(dev_logits, PatienceRule(patience), num_blocks), labels, num_blocks)
        if s["accuracy"] >= head_acc - max_drop:
            return patience, s
    patience = num_blocks - 1
    return patience, summarize_exits(simulate_exits(dev_logits, PatienceRule(patience), num_blocks), labels,
                                     num_blocks)


def _batches(n: int, batch_size: int, rng: np.random.Generator, lengths: np.ndarray | None = None):
    """Shuffled batches; with ``lengths``, batches of similar length (less padding to compute)."""
    order = rng.permutation(n)
    if lengths is not None:
        # Sort within chunks of 50 batches by length, then shuffle the batches.
        chunk = batch_size * 50
        order = np.concatenate([c[np.argsort(lengths[c], kind="stable")] for c in np.split(order, range(chunk, n, chunk))])
    batches = [order[i:i + batch_size] for i in range(0, n, batch_size)]
    rng.shuffle(batches)
    return batches


def finetune_head(model, ids: np.ndarray, mask: np.ndarray, *, labels: np.ndarray, epochs: int = 1,
                  lr: float = 5e-5, batch_size: int = 32, seed: int = 0, freeze_embeddings: bool = True,
                  progress: bool = True) -> list[float]:
    """DeeBERT stage 1 (encoder models): fine-tune backbone + final head on the head's loss.

    Batches are bucketed by length and trimmed to their longest input (the
    attention mask makes padding irrelevant), AdamW with linear decay.
    Returns the loss per step.
    """
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    if freeze_embeddings:  # 30522x384 word embeddings: most of the parameters, little of the gain
        model.embeddings.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    lengths = mask.sum(1)
    steps = [b for _ in range(epochs) for b in _batches(len(ids), batch_size, rng, lengths)]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: max(0.0, 1 - i / max(1, len(steps))))
    L = model.card.num_blocks
    use_bf16 = bf16_available()
    model.train()
    losses = []
    bar = tqdm(steps, desc="stage 1: backbone + head", unit="batch", disable=not progress)
    for idx in bar:
        width = int(lengths[idx].max())
        x = torch.as_tensor(ids[idx, :width]), torch.as_tensor(mask[idx, :width])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            state = model.stem(*x)
            for k in range(1, L + 1):
                state = model.block(k, *state)
            logits = model.ramp(L, *state).float()
        _step(opt, sched, nn.functional.cross_entropy(logits, torch.as_tensor(labels[idx])), losses, bar)
    model.eval()
    model.embeddings.requires_grad_(True)
    return losses


def train_joint(model: EarlyExitModel, images: np.ndarray, labels: np.ndarray, *, epochs: int = 2,
                lr: float = 2e-3, batch_size: int = 128, seed: int = 0, progress: bool = True) -> list[float]:
    """BranchyNet: train the backbone and every exit together on the sum of their losses."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    steps = [b for _ in range(epochs) for b in _batches(len(images), batch_size, rng)]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: max(0.05, 1 - i / max(1, len(steps))))
    exits = set(model.card.exit_blocks)
    use_bf16 = bf16_available()
    model.train()
    losses = []
    bar = tqdm(steps, desc=f"train {model.card.name} (all exits jointly)", unit="batch", disable=not progress)
    for idx in bar:
        y = torch.as_tensor(labels[idx])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            state = model.stem(torch.as_tensor(images[idx]))
            loss = 0.0
            for k in range(1, model.card.num_blocks + 1):
                state = model.block(k, *state)
                if k in exits:
                    loss = loss + nn.functional.cross_entropy(model.ramp(k, *state).float(), y)
        _step(opt, sched, loss, losses, bar)
    model.eval()
    return losses


def _step(opt, sched, loss, losses: list[float], bar) -> None:
    """One optimiser step; the loss is logged and shown as a running mean on the progress bar."""
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    losses.append(loss.item())
    bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")


@torch.no_grad()
def encoder_pooled_features(model, ids: np.ndarray, mask: np.ndarray, *, batch_size: int = 128,
                            progress: bool = True, desc: str = "cache pooled states") -> dict[int, np.ndarray]:
    """Encoder models: what a ramp's pooler reads after every block ([CLS] or masked mean),
    block -> [N, H]. Batches trimmed to their longest input."""
    model.eval()
    lengths = mask.sum(1)
    out = {k: np.zeros((len(ids), model.config.hidden), np.float32) for k in range(1, model.card.num_blocks + 1)}
    order = np.argsort(lengths)
    for start in tqdm(range(0, len(ids), batch_size), desc=desc, unit="batch", disable=not progress, leave=False):
        idx = order[start:start + batch_size]
        width = int(lengths[idx].max())
        state = model.stem(torch.as_tensor(ids[idx, :width]), torch.as_tensor(mask[idx, :width]))
        for k in range(1, model.card.num_blocks + 1):
            state = model.block(k, *state)
            out[k][idx] = model.head.pool(state[0], state[1]).numpy()
    return out


def train_ramps_on_pooled(model, feats: dict[int, np.ndarray], labels: np.ndarray, *, blocks: tuple[int, ...],
                       epochs: int = 30, lr: float = 1e-3, batch_size: int = 128, seed: int = 0,
                       progress: bool = True) -> None:
    """DeeBERT stage 2: train each ramp on cached pooled states, backbone frozen.

    A ramp only reads its block's pooled state, so training on the cache is
    exactly training with the frozen backbone in the loop, minus its cost.
    """
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    y = torch.as_tensor(labels)
    for k in tqdm(blocks, desc="stage 2: ramps", unit="ramp", disable=not progress):
        ramp = model.ramps[str(k)]
        ramp.train()
        opt = torch.optim.Adam(ramp.parameters(), lr=lr)
        x = torch.as_tensor(feats[k])
        for _ in range(epochs):
            for idx in _batches(len(x), batch_size, rng):
                loss = nn.functional.cross_entropy(ramp.from_pooled(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        ramp.eval()
