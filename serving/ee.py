"""``<m>_ee``: the early-exit model served the way its authors run it (DESIGN §2).

One model, one process: blocks run back to back in ONNX Runtime (one file
per block, ``block_<k>.onnx``, holding its ramp if enabled), the exit rule is
checked after every enabled ramp, and the batch shrinks in place as inputs
exit. No Triton hop between blocks, no re-batching: the strongest naive form,
hence the fair baseline for E3.
"""

from __future__ import annotations

import json
import os
from functools import partial

from e3.core.exits import make_exit_rule
from e3.core.spec import ModelCard
from e3.serving.policy import BatchRoute
from e3.core.session import make_session
from e3.serving.triton_io import answer_responses, gather, model_parameters


class TritonPythonModel:
    def initialize(self, args):
        _, params = model_parameters(args)
        self.card = ModelCard.from_dict(json.loads(params["model_card"]))
        self.rule = make_exit_rule(json.loads(params["exit_rule"]))
        self.enabled = set(json.loads(params["enabled_ramps"]))
        threads = int(params.get("intra_op_threads", "1"))
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        L = self.card.num_blocks
        self.blocks = [make_session(os.path.join(version_dir, f"block_{k}.onnx"), threads) for k in range(1, L + 1)]

    def execute(self, requests):
        got = gather(requests, self.card.inputs)
        if not got.valid:
            return got.responses
        route = BatchRoute(got.rows, self.card.num_classes, self.card.num_blocks, self.rule)
        steps = ((self.card.split_ramps(k, k, self.enabled), partial(self._block, k))
                 for k in range(1, self.card.num_blocks + 1))
        route.follow(got.arrays, steps, [t.name for t in self.card.state])
        return answer_responses(got, route)

    def _block(self, k: int, feed: dict) -> dict:
        """Block k (with its ramp if enabled) in ONNX Runtime, on the rows still running."""
        names = self.card.split_outputs(k, k, self.enabled)
        return dict(zip(names, self.blocks[k - 1].run(names, feed)))
