"""The early-exit model interface every part works from (export, reference, profiler).

An early-exit model is: a stem, blocks 1..L, a ramp after some blocks, and a
final head after block L. Between blocks it carries a *state*: a tuple of
tensors named by ``card.state`` (for a text encoder: the hidden states and the
attention mask). Block 1's split also holds the stem; block L's split the head.

Implement :class:`EarlyExitModel` for your own model and pass
``package.module:factory`` wherever a command takes a model name.
"""

from __future__ import annotations

import abc

import torch
from torch import nn

from e3.core.spec import ModelCard

__all__ = ["EarlyExitModel", "SplitModule"]


class EarlyExitModel(nn.Module, abc.ABC):
    """An early-exit DNN, described by its :class:`~e3.core.spec.ModelCard`."""

    card: ModelCard

    @abc.abstractmethod
    def stem(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Model inputs (``card.inputs``, batch first) -> state before block 1."""

    @abc.abstractmethod
    def block(self, k: int, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Run block ``k`` (1..L): state -> state."""

    @abc.abstractmethod
    def ramp(self, k: int, *state: torch.Tensor) -> torch.Tensor:
        """Logits [B, C] of the ramp after block ``k`` (k in card.ramp_blocks), or of
        the final head when ``k == L``."""

    @abc.abstractmethod
    def example_inputs(self, n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """``n`` valid random inputs (batch first), deterministic in ``seed``."""

    def example_arrays(self, n: int, seed: int = 0) -> dict:
        """:meth:`example_inputs` as numpy arrays named like the model's inputs (what a client sends)."""
        return {spec.name: x.numpy() for spec, x in zip(self.card.inputs, self.example_inputs(n, seed=seed))}


class SplitModule(nn.Module):
    """Blocks ``first..last`` of a model as one module, the unit that is exported.

    forward(*x): x is the model's inputs if ``first == 1``, else the state.
    Returns the state after ``last`` (omitted when ``last == L``), then the
    logits of every ramp in ``ramps`` in ascending block order (the head is
    ramp L). A ramp not in ``ramps`` is not computed at all (E3 §3.4).
    """

    def __init__(self, model: EarlyExitModel, first: int, last: int, ramps: tuple[int, ...]):
        super().__init__()
        L = model.card.num_blocks
        if not 1 <= first <= last <= L:
            raise ValueError(f"split {first}-{last} is outside blocks 1..{L}")
        self.model, self.first, self.last = model, first, last
        self.ramps = model.card.split_ramps(first, last, ramps)
        # A split is only ever run for inference; exporting restores the wrapper's
        # mode recursively, so a wrapper left in training mode would switch the
        # model's dropout on.
        self.eval()

    def forward(self, *x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state = self.model.stem(*x) if self.first == 1 else x
        outs = []
        for k in range(self.first, self.last + 1):
            state = self.model.block(k, *state)
            if k in self.ramps:
                outs.append(self.model.ramp(k, *state))
        return (*(state if self.last < self.model.card.num_blocks else ()), *outs)

    @property
    def input_specs(self):
        return self.model.card.inputs if self.first == 1 else self.model.card.state_after(self.first - 1)

    @property
    def output_names(self) -> list[str]:
        return self.model.card.split_outputs(self.first, self.last, self.ramps)

