"""Train the walk-through's model on a synthetic task and write its data file (about a minute on 2 cores).

Task: four classes of 32-feature points around four centres; a point's difficulty is its distance from its
centre, so some leave at ramp 1 and some need the head. Writes ``summit.pt`` (weights) and
``summit_data.npz`` (``x``: float32 [10000, 32], ``labels``: int64 [10000]: held-out points, the format
``--data`` reads; enough for a load run of a few seconds).
"""

from __future__ import annotations

import numpy as np
import torch

from summit import C, F, WEIGHTS, Summit


def points(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(0).normal(size=(C, F)) * 0.5
    labels = rng.integers(0, C, n)
    spread = rng.choice([0.5, 1.5, 2.5], size=(n, 1), p=[0.4, 0.35, 0.25])   # easy, medium, hard points
    x = centres[labels] + rng.normal(size=(n, F)) * spread
    return x.astype(np.float32), labels.astype(np.int64)


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Summit({"kind": "patience", "patience": 1})
    x, y = (torch.as_tensor(a) for a in points(6000, seed=1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(150):      # every ramp and the head learn the task (summed losses, DeeBERT-style)
        idx = torch.randint(0, len(x), (128,))
        state = model.stem(x[idx])
        loss = 0.0
        for k in range(1, 6):
            state = model.block(k, *state)
            loss = loss + torch.nn.functional.cross_entropy(model.ramp(k, *state), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.save(model.state_dict(), WEIGHTS)
    xt, yt = points(10_000, seed=2)
    np.savez("summit_data.npz", x=xt, labels=yt)
    print(f"wrote {WEIGHTS.name} and summit_data.npz ({len(yt)} held-out points); last training loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
