"""How each zoo model is trained (`e3 train NAME`): data, stages, settings, checkpoints.

BERT family (DeeBERT recipe, on all-MiniLM-L6-v2 and the Rotten Tomatoes snippets):

* stage 1 (shared, checkpoint ``bert-stage1``): fine-tune backbone + final
  classifier on the head's loss: 1 epoch, AdamW 5e-5, batch 32, word
  embeddings frozen (CPU budget; they hold most parameters);
* ``bert-stock``: the stage-1 model without ramps (E3's BERT-BASE baseline);
* ``bert-ee``: stage-1 backbone and head + a DeeBERT ramp after layers 1-5,
  trained on cached pooled states with the backbone frozen (stage 2);
  τ chosen on dev (largest τ within 1.5 points of the head's dev accuracy);
* ``pabee``: the same frozen stage-1 backbone with its own ramps, trained the
  same way (seed 1) and PABEE's patience rule; patience chosen on dev.
  Deviation from PABEE (which trains backbone and classifiers jointly with a
  weighted loss): with the backbone frozen, each classifier's loss is
  independent, so the weighting has no effect; documented here.

ResNet family (BranchyNet recipe, Fashion-MNIST): ``resnet-ee`` trains the
backbone and its five branches jointly (2 epochs, Adam 2e-3, batch 128), τ
chosen on dev as for bert-ee; ``resnet-stock`` trains the same backbone with
the head only.

``quick=True`` trains on a few hundred examples (tests, CI): it exercises the
whole pipeline in seconds and says so in the checkpoint's metadata.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from e3.core.exits import make_exit_rule
from e3.core.files import atomic_path
from e3.models.checkpoints import CheckpointMissing, checkpoint_dir, load_meta, load_state, save_checkpoint
from e3.models.data.images import fashion_mnist, fashion_sha256
from e3.models.data.text import Tokenizer, corpus_sha256, rotten_tomatoes
from e3.models.training import (all_exit_logits, choose_patience, choose_tau, encoder_pooled_features, finetune_head,
                                simulate_exits, summarize_exits, train_joint, train_ramps_on_pooled)
from e3.models.zoo import resolve_model
from e3.models.zoo.encoder import EncoderEE
from e3.models.zoo.minilm import build_minilm_ee, minilm_config
from e3.models.zoo.resnet import ResNetEE
from e3.paths import artifacts_dir

__all__ = ["RECIPES", "STOCK_OF", "train", "missing_checkpoints", "TrainReport"]

log = logging.getLogger(__name__)
RECIPE_VERSION = 2  # bump when a recipe changes what it trains (2: ramps and head read mean-pooled states)


@dataclass
class TrainReport:
    name: str
    seconds: float
    meta: dict


def _text_data(quick: bool):
    data = rotten_tomatoes()
    tok = Tokenizer()
    limits = {"train": 384, "dev": 256, "test": 256} if quick else {}
    out = {}
    for split, part in data.items():
        n = limits.get(split, len(part.texts))
        ids, mask = tok(part.texts[:n])
        out[split] = (ids, mask, part.labels[:n])
    return out, corpus_sha256()


def _stage1(quick: bool, progress: bool):
    """The fine-tuned backbone + head, trained once and cached as checkpoint ``bert-stage1``."""
    data, sha = _text_data(quick)
    try:
        meta = load_meta("bert-stage1")
        if meta.get("quick") == quick and meta.get("data_sha256") == sha and meta.get("recipe") == RECIPE_VERSION:
            model = EncoderEE("bert-stage1", minilm_config(), exit_rule={"kind": "entropy", "tau_nats": 0.0})
            model.load_state_dict(load_state("bert-stage1"))
            return model.eval(), data, sha, meta
    except CheckpointMissing:
        pass
    start = time.perf_counter()
    model = build_minilm_ee("bert-stage1", {"kind": "entropy", "tau_nats": 0.0})
    settings = dict(epochs=1, lr=5e-5, batch_size=32, seed=0, freeze_embeddings=True)
    ids, mask, labels = data["train"]
    losses = finetune_head(model, ids, mask, labels=labels, progress=progress, **settings)
    meta = {"quick": quick, "data_sha256": sha, "recipe": RECIPE_VERSION, "settings": settings,
            "final_loss": float(np.mean(losses[-20:])),
            "seconds": time.perf_counter() - start, "train_examples": int(len(ids))}
    save_checkpoint("bert-stage1", model, meta)
    return model.eval(), data, sha, meta


def _pooled_cache(model, data, sha, quick, progress):
    path = artifacts_dir() / "cache" / f"bert-stage1-pooled{'-quick' if quick else ''}.npz"
    if path.exists():
        cached = np.load(path)
        if str(cached["sha"]) == f"{sha}-{RECIPE_VERSION}":
            return {split: {k: cached[f"{split}_{k}"] for k in range(1, model.card.num_blocks + 1)}
                    for split in data}
    feats = {split: encoder_pooled_features(model, ids, mask, progress=progress, desc=f"cache pooled states ({split})")
             for split, (ids, mask, _) in data.items()}
    with atomic_path(path) as tmp:
        np.savez(tmp, sha=f"{sha}-{RECIPE_VERSION}",
                 **{f"{s}_{k}": v for s, f in feats.items() for k, v in f.items()})
    return feats


def _ramp_logits(model, feats: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    with torch.no_grad():
        return {k: (model.head if k == model.card.num_blocks else model.ramps[str(k)]).from_pooled(
            torch.as_tensor(feats[k])).numpy() for k in model.card.exit_blocks}


def _per_ramp_accuracy(logits, labels):
    return {int(k): float((v.argmax(1) == labels).mean()) for k, v in logits.items()}


def _train_bert(name: str, quick: bool, progress: bool) -> dict:
    stage1, data, sha, stage1_meta = _stage1(quick, progress)
    L = stage1.card.num_blocks
    base = {"quick": quick, "data_sha256": sha, "stage1": stage1_meta, "max_seq_len": stage1.config.max_seq_len}
    if name == "bert-stock":
        model = EncoderEE("bert-stock", minilm_config(ramps=()), exit_rule={"kind": "entropy", "tau_nats": 0.0})
        model.load_state_dict({k: v for k, v in stage1.state_dict().items() if not k.startswith("ramps.")})
        feats = _pooled_cache(stage1, data, sha, quick, progress)
        acc = float((_ramp_logits(stage1, feats["test"])[L].argmax(1) == data["test"][2]).mean())
        meta = {**base, "test_accuracy": acc, "exit_rule": None}
        save_checkpoint(name, model, meta)
        return meta
    feats = _pooled_cache(stage1, data, sha, quick, progress)
    model = EncoderEE(name, minilm_config(), exit_rule={"kind": "entropy", "tau_nats": 0.0})
    model.load_state_dict(stage1.state_dict())
    seed = 0 if name == "bert-ee" else 1
    settings = dict(epochs=20 if not quick else 10, lr=1e-3, batch_size=128, seed=seed)
    train_ramps_on_pooled(model, feats["train"], data["train"][2], blocks=model.card.ramp_blocks, progress=progress,
                       **settings)
    dev, test = _ramp_logits(model, feats["dev"]), _ramp_logits(model, feats["test"])
    if name == "bert-ee":
        tau, dev_summary = choose_tau(dev, data["dev"][2], L)
        rule = {"kind": "entropy", "tau_nats": tau}
    else:
        patience, dev_summary = choose_patience(dev, data["dev"][2], L)
        rule = {"kind": "patience", "patience": patience}
    test_summary = summarize_exits(simulate_exits(test, make_exit_rule(rule), L), data["test"][2], L)
    meta = {**base, "exit_rule": rule, "ramp_settings": settings, "dev": dict(dev_summary),
            "test": dict(test_summary), "per_ramp_test_accuracy": _per_ramp_accuracy(test, data["test"][2])}
    save_checkpoint(name, model, meta)
    return meta


def _train_resnet(name: str, quick: bool, progress: bool, retune_only: bool = False) -> dict:
    """BranchyNet recipe: branches and backbone trained jointly (sum of the exits' losses,
    weight 1 each); the stock model is the same backbone with its head only, trained alone."""
    data = fashion_mnist()
    n = {"train": 1024, "dev": 512, "test": 512} if quick else {}
    split = {k: (v.images[:n.get(k, len(v.images))], v.labels[:n.get(k, len(v.labels))]) for k, v in data.items()}
    stock = name == "resnet-stock"
    torch.manual_seed(0)
    model = ResNetEE(name, {"kind": "entropy", "tau_nats": 0.0}, ramps=() if stock else (1, 2, 3, 4, 5))
    settings = dict(epochs=1 if quick else 2, lr=2e-3, batch_size=128, seed=0)
    if retune_only:  # keep the trained weights, choose τ again
        model.load_state_dict(load_state(name))
        settings = load_meta(name).get("settings", settings)
    else:
        train_joint(model, *split["train"], progress=progress, **settings)
    L = model.card.num_blocks
    dev = all_exit_logits(model, (split["dev"][0],), batch_size=256)
    test = all_exit_logits(model, (split["test"][0],), batch_size=256)
    base = {"quick": quick, "data_sha256": fashion_sha256(), "settings": settings, "max_seq_len": None}
    if stock:
        meta = {**base, "exit_rule": None, "test_accuracy": float((test[L].argmax(1) == split["test"][1]).mean())}
    else:
        reference = None
        try:  # the stock model's dev accuracy is the reference (its head is trained alone)
            stock_model = resolve_model("resnet-stock")
            stock_dev = all_exit_logits(stock_model, (split["dev"][0],), batch_size=256)
            reference = float((stock_dev[L].argmax(1) == split["dev"][1]).mean())
        except CheckpointMissing:
            log.warning("resnet-stock is not trained: choosing τ against resnet-ee's own head")
        tau, dev_summary = choose_tau(dev, split["dev"][1], L, reference_accuracy=reference)
        rule = {"kind": "entropy", "tau_nats": tau}
        meta = {**base, "exit_rule": rule, "dev": dict(dev_summary), "tau_reference_accuracy": reference,
                "test": dict(summarize_exits(simulate_exits(test, make_exit_rule(rule), L), split["test"][1], L)),
                "per_ramp_test_accuracy": _per_ramp_accuracy(test, split["test"][1])}
    save_checkpoint(name, model, meta)
    return meta


RECIPES = {"bert-ee": _train_bert, "bert-stock": _train_bert, "pabee": _train_bert,
           "resnet-ee": _train_resnet, "resnet-stock": _train_resnet}


STOCK_OF = {"bert-ee": "bert-stock", "pabee": "bert-stock", "resnet-ee": "resnet-stock"}


def missing_checkpoints(name: str) -> list[str]:
    """What must be trained before ``name`` can be exported (its stock counterpart, then itself)."""
    if name not in RECIPES:
        return []
    needed = [STOCK_OF[name], name] if name in STOCK_OF else [name]
    return [n for n in needed if not (checkpoint_dir(n) / "meta.json").exists()]


def train(name: str, quick: bool = False, progress: bool = True, *, retune: bool = False) -> TrainReport:
    """Train zoo model ``name`` (cached: stage 1 is shared and reused). ``retune``: keep the
    trained weights of resnet-ee and choose its τ again (BERT models retrain only their ramps anyway)."""
    if name not in RECIPES:
        raise ValueError(f"no training recipe for {name!r}; trainable: {', '.join(sorted(RECIPES))}")
    start = time.perf_counter()
    if retune and name != "resnet-ee":
        raise ValueError("--retune applies to resnet-ee; bert-ee and pabee rerun only their ramps (about a minute)")
    meta = _train_resnet(name, quick, progress, retune_only=True) if retune else RECIPES[name](name, quick, progress)
    return TrainReport(name, time.perf_counter() - start, meta)
