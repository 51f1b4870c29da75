"""``<m>_ee``: the early-exit model served the way its authors run it (docs/design.md §2).

One model, one process: blocks 1..L run back to back in ONNX Runtime, the exit rule is checked after every
enabled ramp, and the batch shrinks in place as inputs exit. No Triton hop between blocks, no re-batching:
the strongest naive form, hence the fair baseline for E3.

It runs the code E3's compact split runs (:class:`~e3.serving.compact.CompactRunner`), over the whole model:
under an entropy rule the L blocks, their exit tests and the compaction between them are one composed ONNX
graph, one ONNX Runtime call per batch (:mod:`e3.serving.fused_split`); under another rule (PABEE's
patience) or for blocks that do not compose, one call per block file (``block_<k>[_ramp].onnx``, with its
ramp where enabled), the rule in numpy between them. The Triton log says which form loaded and why.
"""

from __future__ import annotations

import json
import os

import triton_python_backend_utils as pb_utils

from e3.core.exits import SHIPPED_RULES_DIR, make_exit_rule
from e3.core.spec import ModelCard
from e3.serving.compact import CompactRunner
from e3.serving.triton_io import answer_responses, gather, model_parameters


class TritonPythonModel:
    def initialize(self, args):
        _, params = model_parameters(args)
        self.card = ModelCard.from_dict(json.loads(params["model_card"]))
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        # a user's rule: its module shipped beside the model by export (e3.export.rules)
        rule = make_exit_rule(json.loads(params["exit_rule"]), paths=[os.path.join(version_dir, SHIPPED_RULES_DIR)])
        reads = {part: io["reads"] for part, io in json.loads(params.get("part_io") or "{}").items()}
        self.run = CompactRunner(version_dir, self.card, rule, 1, self.card.num_blocks,
                                 json.loads(params["enabled_ramps"]), threads=int(params.get("intra_op_threads", "1")),
                                 reads=reads)
        pb_utils.Logger.log_info(f"{args['model_name']}: blocks 1-{self.card.num_blocks} run {self.run.form}"
                                 + (f": {self.run.why}" if self.run.why else " (one graph)"))

    def execute(self, requests):
        got = gather(requests, self.card.inputs)
        if not got.valid:
            return got.responses
        route, _ = self.run(got.arrays)
        return answer_responses(got, route)
