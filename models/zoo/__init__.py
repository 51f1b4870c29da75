"""Early-exit model zoo. A model is named by a zoo name (``tiny-ee``) or by
``package.module:factory``, a callable returning an :class:`EarlyExitModel`.

Each zoo entry also builds its stock counterpart (same task, no ramps), served
as ``<m>_stock``. For a user's own model the stock baseline is the same model
with every ramp removed (its final head only).
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from safetensors.torch import load_model

from e3.models.api import EarlyExitModel
from e3.models.checkpoints import load_meta, load_state
from e3.models.data.text import MAX_SEQ_LEN
from e3.models.zoo.encoder import EncoderConfig, EncoderEE
from e3.models.zoo.minilm import minilm_config
from e3.models.zoo.resnet import ResNetEE
from e3.models.zoo.tiny import build_tiny_ee

__all__ = ["ZooEntry", "ZOO", "resolve_model", "resolve_stock", "resolve_architecture", "load_shipped_model",
           "UnknownModelError"]


class UnknownModelError(ValueError):
    """A model name that is neither in the zoo nor an importable ``module:factory``."""


@dataclass(frozen=True)
class ZooEntry:
    name: str
    summary: str
    build: Callable[[], EarlyExitModel]          # the early-exit model, weights loaded, eval mode
    build_stock: Callable[[], EarlyExitModel] | None = None  # stock counterpart (None: the EE model's head path)
    dataset: str | None = None                   # e3.models.data dataset its evaluation and workloads use
    architecture: Callable[[], EarlyExitModel] | None = None  # the same model with random weights (None: build)


def _tiny() -> EarlyExitModel:
    return build_tiny_ee()


def _encoder(name: str, meta: dict, ramps: tuple[int, ...]) -> EarlyExitModel:
    return EncoderEE(name, minilm_config(max_seq_len=meta.get("max_seq_len", MAX_SEQ_LEN), ramps=ramps),
                     exit_rule=meta.get("exit_rule") or {"kind": "entropy", "tau_nats": 0.0}, preprocess="minilm")


# BERT-base's shape (12 layers x 768, 12 heads, FFN 3072) at 128 tokens, ramps after layers 1-11: the
# GPU side-by-side's larger model (docs/gpu.md). Random weights: speed only, with exits stated (the
# GPU runs' 80:20 mix: easy inputs leave after layer 2); never trained, never evaluated.
BERT_BASE = dict(vocab_size=30522, hidden=768, layers=12, heads=12, ffn=3072, max_seq_len=128, num_classes=2)
BERT_BASE_REACH = {"80-20": [1.0, 1.0] + [0.2] * 10, "50-50": [1.0, 1.0] + [0.5] * 10}


def _bert_base() -> EarlyExitModel:
    torch.manual_seed(0)
    config = EncoderConfig(**BERT_BASE, ramp_blocks=tuple(range(1, 12)))
    return EncoderEE("bert-base-ee", config, exit_rule={"kind": "forced", "reach": BERT_BASE_REACH["80-20"]},
                     max_batch_size=256)


def _resnet(name: str, meta: dict, ramps: tuple[int, ...]) -> EarlyExitModel:
    return ResNetEE(name, meta.get("exit_rule") or {"kind": "entropy", "tau_nats": 0.0}, ramps=ramps)


def _trained(architecture, name: str, ramps: bool = True) -> Callable[[], EarlyExitModel]:
    """A builder that loads checkpoint ``name`` into ``architecture`` (ramps after blocks 1-5, or none)."""
    def build() -> EarlyExitModel:
        model = architecture(name, load_meta(name), (1, 2, 3, 4, 5) if ramps else ())
        model.load_state_dict(load_state(name))
        return model
    return build


def _ee_entry(name: str, summary: str, architecture, stock: str, data: str) -> ZooEntry:
    """A trained early-exit model whose stock baseline is checkpoint ``stock`` of the same architecture."""
    return ZooEntry(name, summary, _trained(architecture, name), _trained(architecture, stock, ramps=False), data,
                    lambda: architecture(name, {}, (1, 2, 3, 4, 5)))


def _stock_entry(name: str, summary: str, architecture, data: str) -> ZooEntry:
    """A trained stock model (final head only); it is its own baseline."""
    return ZooEntry(name, summary, _trained(architecture, name, ramps=False), None, data,
                    lambda: architecture(name, {}, ()))


ZOO: dict[str, ZooEntry] = {e.name: e for e in (
    ZooEntry("tiny-ee", "4-layer transformer encoder, random weights, ramps after layers 1-3 (demo/tests)", _tiny),
    ZooEntry("bert-base-ee", "BERT-base-sized encoder (12 x 768, 128 tokens), random weights, ramps after layers "
             "1-11, forced exits (GPU speed runs only)", _bert_base),
    _ee_entry("bert-ee", "all-MiniLM-L6-v2 + DeeBERT ramps after layers 1-5, entropy exits; Rotten Tomatoes "
              "(`e3 train bert-ee`)", _encoder, "bert-stock", "rotten-tomatoes"),
    _stock_entry("bert-stock", "all-MiniLM-L6-v2 fine-tuned, final classifier only (the stock baseline)",
                 _encoder, "rotten-tomatoes"),
    _ee_entry("pabee", "all-MiniLM-L6-v2 + PABEE classifiers after layers 1-5, patience exits (`e3 train pabee`)",
              _encoder, "bert-stock", "rotten-tomatoes"),
    _ee_entry("resnet-ee", "BranchyNet-style ResNet (6 blocks, branches after 1-5), entropy exits; Fashion-MNIST "
              "(`e3 train resnet-ee`)", _resnet, "resnet-stock", "fashion-mnist"),
    _stock_entry("resnet-stock", "the same ResNet, final head only (the stock baseline)", _resnet, "fashion-mnist"),
)}


def resolve_model(name: str) -> EarlyExitModel:
    """Build the early-exit model ``name`` (zoo name or ``package.module:factory``), in eval mode."""
    if name in ZOO:
        model = ZOO[name].build()
    elif ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise UnknownModelError(f"cannot import model factory {name!r}: {err}") from None
        model = factory()
        if not isinstance(model, EarlyExitModel):
            raise UnknownModelError(f"{name!r} returned {type(model).__name__}, not an EarlyExitModel")
    else:
        raise UnknownModelError(f"unknown model {name!r}; zoo models: {', '.join(sorted(ZOO))}, "
                                "or name your own as package.module:factory")
    return model.eval()


def resolve_architecture(name: str) -> EarlyExitModel:
    """``name``'s architecture with random weights, in eval mode: for timing it where its trained
    checkpoint is not (a GPU host, say). A latency does not depend on the weights' values; exits do, so
    never serve or evaluate this. Models without a checkpoint (``tiny-ee``, ``package.module:factory``)
    are built as :func:`resolve_model` builds them."""
    entry = ZOO.get(name)
    if entry is not None and entry.architecture is not None:
        return entry.architecture().eval()
    return resolve_model(name)


def resolve_stock(name: str) -> EarlyExitModel:
    """The stock counterpart of ``name``; served with only its final head."""
    entry = ZOO.get(name)
    if entry is not None and entry.build_stock is not None:
        return entry.build_stock().eval()
    return resolve_model(name)


def load_shipped_model(name: str, weights: str, *, modules: str | None = None) -> EarlyExitModel:
    """The model ``e3 export`` shipped beside a router: ``name``'s architecture (a zoo name, or a user's
    ``package.module:factory`` imported from ``modules``, the folder its module was shipped to: Triton's stub
    ignores ``PYTHONPATH``) with the state dict in the safetensors file ``weights``, in eval mode. Every tensor
    must match: a missing or unexpected one raises (a model that changed since its export is not served).
    The exporter loads what it shipped with this very function, so a model that would not load fails the
    export, not the serve."""
    if modules and os.path.isdir(modules) and modules not in sys.path:
        sys.path.insert(0, modules)
    model = resolve_architecture(name)
    load_model(model, weights, strict=True)
    return model.eval()
