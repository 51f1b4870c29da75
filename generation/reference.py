"""Reference decoders in PyTorch, one sequence at a time: what served generation must reproduce.

* :func:`generate_full` — the full model, greedy.
* :func:`generate_early_exit` — CALM-style token-level early exit, greedy: a token leaves at the first exit
  head whose softmax-margin confidence is >= ``tau``; the prompt is always run through every layer (no exits
  in prefill) and the first new token comes from the final head. Layers the token skipped still need its
  key/value for later tokens; two ways, chosen by ``kv_fill``:

  - ``"copy"`` (CALM, what serving does): each skipped layer's k/v is computed from the exit layer's hidden
    state (that layer's input norm and k/v projections only: no attention, no MLP);
  - ``"recompute"``: skipped positions stay pending and are run through the layers they skipped, as a chunk
    together with the next token that goes deeper (their exact states, paid later).

* :func:`generate_self_speculative` — LayerSkip-style lossless decoding: draft ``draft_tokens`` tokens with
  layers 1..e and the exit head after ``e``, then run layers e+1..L once over the drafted positions (the draft
  already computed layers 1..e for them, with the same cache) and keep the longest prefix the full model
  agrees with, plus its correction. Output equals :func:`generate_full`'s.

Every function returns a :class:`Generation`. Stops after ``max_new_tokens`` or at ``eos_id`` (kept).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from e3.generation.decoder import Decoder, attention_mask, softmax_margin

__all__ = ["Generation", "KVCache", "generate_full", "generate_early_exit", "generate_self_speculative",
           "prefill"]


_CHEAP = ("saturation", "classifier")   # the columns of Decoder.exit_scores


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)        # new tokens, in order
    exit_layers: list[int] = field(default_factory=list)   # per token: the layer whose head chose it (L: final)
    confidences: list[float] = field(default_factory=list)  # per token: its head's softmax margin
    layers_run: int = 0                                     # decoder layers executed (positions x layers)
    drafted: int = 0                                        # self-speculative: draft tokens proposed
    accepted: int = 0                                       # self-speculative: of them, accepted
    cache: "KVCache | None" = field(default=None, repr=False)  # the sequence's cache at the end


class KVCache:
    """Per layer k, v [1, kvh, T_l, d] of one sequence (T_l may differ between layers while recomputing)."""

    def __init__(self, model: Decoder):
        c = model.config
        empty = torch.zeros(1, c.num_kv_heads, 0, c.head_dim)
        self.k = [empty] * c.num_layers
        self.v = [empty] * c.num_layers

    def length(self, layer: int) -> int:
        return self.k[layer - 1].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer - 1] = torch.cat((self.k[layer - 1], k), dim=2)
        self.v[layer - 1] = torch.cat((self.v[layer - 1], v), dim=2)

    def truncate(self, length: int) -> None:
        self.k = [k[:, :, :length] for k in self.k]
        self.v = [v[:, :, :length] for v in self.v]


def _run(model: Decoder, cache: KVCache, h: torch.Tensor, first_position: int, first: int, last: int) -> torch.Tensor:
    """Layers first..last on chunk h [1, S, H] at positions first_position.., appending to the cache."""
    s = h.shape[1]
    cos, sin = model.rope(torch.arange(first_position, first_position + s)[None])
    for layer in range(first, last + 1):
        past = cache.length(layer)
        mask = attention_mask(torch.ones(1, past + s, dtype=torch.bool), s)
        h, k, v = model.layer_forward(layer, h, cos, sin, cache.k[layer - 1], cache.v[layer - 1], mask)
        cache.append(layer, k, v)
    return h


def prefill(model: Decoder, prompt: list[int]) -> tuple[KVCache, int]:
    """Run the prompt through every layer; (cache, first new token from the final head)."""
    if not prompt:
        raise ValueError("empty prompt: at least one token is needed")
    cache = KVCache(model)
    L = model.config.num_layers
    h = _run(model, cache, model.embed(torch.tensor([prompt])), 0, 1, L)
    return cache, int(model.head_logits(h[:, -1], L).argmax())


def _done(out: Generation, max_new_tokens: int, eos_id: int | None) -> bool:
    return len(out.tokens) >= max_new_tokens or (eos_id is not None and out.tokens and out.tokens[-1] == eos_id)


@torch.no_grad()
def generate_full(model: Decoder, prompt: list[int], max_new_tokens: int, *, eos_id: int | None = None) -> Generation:
    """Greedy decoding with every layer."""
    return generate_early_exit(model, prompt, max_new_tokens, tau=float("inf"), eos_id=eos_id)


@torch.no_grad()
def generate_early_exit(model: Decoder, prompt: list[int], max_new_tokens: int, *, tau: float,
                        eos_id: int | None = None, kv_fill: str = "copy",
                        exit_layers: tuple[int, ...] | None = None, depth: int | None = None,
                        measure: str = "softmax", thresholds: dict[int, float] | None = None) -> Generation:
    """Greedy CALM decoding (see the module docstring); ``exit_layers`` (default: all the model's heads)
    selects which heads may answer; ``tau`` > 1 never exits.

    ``measure``: the confidence compared with the threshold: ``softmax`` (the head's margin), or CALM's cheap
    ones, ``saturation`` / ``classifier`` (:meth:`Decoder.exit_scores`; the head is then read only for a
    token that leaves). ``thresholds`` {exit layer: threshold} replaces ``tau`` per exit.

    ``depth`` (an exit layer): the model **partially loaded** up to that layer (HELIOS): the head after
    ``depth`` acts as the final head, for the prompt too, and every token that reaches it leaves there
    whatever its confidence; layers past ``depth`` never run and get no k/v."""
    if measure not in ("softmax", *_CHEAP):
        raise ValueError(f"measure must be softmax, saturation or classifier, not {measure!r}")
    if kv_fill not in ("copy", "recompute"):
        raise ValueError(f"kv_fill must be 'copy' or 'recompute', not {kv_fill!r}")
    full = model.config.num_layers
    L = full if depth is None else depth
    if L != full and L not in model.config.exit_layers:
        raise ValueError(f"depth {depth} is not an exit layer of the model {model.config.exit_layers}")
    exits = sorted(e for e in (model.config.exit_layers if exit_layers is None else exit_layers) if e < L)
    if not prompt:
        raise ValueError("empty prompt: at least one token is needed")
    cache = KVCache(model)                        # the prefill: every (loaded) layer, the last head answers
    h = _run(model, cache, model.embed(torch.tensor([prompt])), 0, 1, L)
    logits = model.head_logits(h[:, -1], L)
    token, conf = int(logits.argmax()), float(softmax_margin(logits))
    out = Generation(tokens=[token], exit_layers=[L], layers_run=len(prompt) * L, confidences=[conf])
    pending: dict[int, torch.Tensor] = {}   # recompute: position -> hidden state it left with
    position = len(prompt)
    while not _done(out, max_new_tokens, eos_id):
        h = model.embed(torch.tensor([[token]]))
        layer, chosen = 0, L
        for stop in [*exits, L]:
            before = h
            for first, last in ((layer + 1, stop - 1), (stop, stop)):   # the state before the exit layer too
                if first > last:
                    continue
                if kv_fill == "recompute" and pending:
                    before, h = h, _run_with_pending(model, cache, h, position, first, last, pending, out)
                else:
                    before, h = h, _run(model, cache, h, position, first, last)
                    out.layers_run += last - first + 1
            layer = stop
            if stop == L:
                break
            threshold = tau if thresholds is None else thresholds[stop]
            if measure == "softmax":
                logits = model.head_logits(h[:, -1], stop)
                conf = float(softmax_margin(logits))
            else:
                conf = float(model.exit_scores(h[:, -1], before[:, -1], stop)[..., _CHEAP.index(measure)])
            if conf >= threshold:
                if measure != "softmax":      # the head, only for the token that leaves
                    logits = model.head_logits(h[:, -1], stop)
                    conf = float(softmax_margin(logits))
                chosen, token = stop, int(logits.argmax())
                break
        if chosen == L:
            logits = model.head_logits(h[:, -1], L)
            token, conf = int(logits.argmax()), float(softmax_margin(logits))
        elif kv_fill == "copy":
            pos = torch.tensor([[position]])
            for skipped in range(chosen + 1, L + 1):
                cache.append(skipped, *model.layer_kv(skipped, h[:, -1:], pos))
        else:
            pending[position] = h[:, -1:]
        out.tokens.append(token)
        out.exit_layers.append(chosen)
        out.confidences.append(conf)
        position += 1
    out.cache = cache
    return out


def _run_with_pending(model: Decoder, cache: KVCache, h: torch.Tensor, position: int, first: int, last: int,
                      pending: dict[int, torch.Tensor], out: Generation) -> torch.Tensor:
    """Layers first..last for the current token, with every pending position that lacks a layer joining the
    chunk at that layer (its stored hidden state carried along), so caches stay complete and in order."""
    for layer in range(first, last + 1):
        behind = [p for p in sorted(pending) if p >= cache.length(layer)]
        chunk = torch.cat([pending[p] for p in behind] + [h], dim=1)
        start = behind[0] if behind else position
        chunk = _run(model, cache, chunk, start, layer, layer)
        out.layers_run += chunk.shape[1]
        for i, p in enumerate(behind):
            pending[p] = chunk[:, i:i + 1]
        h = chunk[:, -1:]
    for p in [p for p in pending if cache.length(model.config.num_layers) > p]:
        del pending[p]   # fully computed
    return h


@torch.no_grad()
def generate_self_speculative(model: Decoder, prompt: list[int], max_new_tokens: int, *, draft_layer: int,
                              draft_tokens: int = 4, eos_id: int | None = None) -> Generation:
    """Lossless self-speculative greedy decoding (see the module docstring); equals :func:`generate_full`."""
    L = model.config.num_layers
    if str(draft_layer) not in model.adapters:
        raise ValueError(f"no exit head after layer {draft_layer}; heads: {model.config.exit_layers}")
    if draft_tokens < 1:
        raise ValueError("draft_tokens must be >= 1")
    cache, token = prefill(model, prompt)
    out = Generation(tokens=[token], exit_layers=[L], layers_run=len(prompt) * L)
    position = len(prompt)
    while not _done(out, max_new_tokens, eos_id):
        k = min(draft_tokens, max_new_tokens - len(out.tokens))
        inputs, hidden, drafts = [token], [], []
        for i in range(k):
            h = _run(model, cache, model.embed(torch.tensor([[inputs[-1]]])), position + i, 1, draft_layer)
            hidden.append(h)
            drafts.append(int(model.head_logits(h[:, -1], draft_layer).argmax()))
            inputs.append(drafts[-1])
        h = _run(model, cache, torch.cat(hidden, dim=1), position, draft_layer + 1, L)
        full = model.head_logits(h[0], L).argmax(-1).tolist()
        out.layers_run += k * L
        accepted = 0
        while accepted < k and drafts[accepted] == full[accepted]:
            accepted += 1
        out.drafted += k
        out.accepted += accepted
        new = drafts if accepted == k else drafts[:accepted] + [full[accepted]]
        kept = k if accepted == k else accepted + 1     # positions whose successor is now known
        cache.truncate(position + kept)
        for i, t in enumerate(new):
            out.tokens.append(t)
            out.exit_layers.append(draft_layer if i < accepted else L)
            if _done(out, max_new_tokens, eos_id):
                break
        position += kept
        token = new[-1]
    out.tokens = out.tokens[:max_new_tokens]
    out.exit_layers = out.exit_layers[:len(out.tokens)]
    return out
