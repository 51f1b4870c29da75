"""``<m>_router``: E3's router as a Triton Python-backend model (BLS).

Per batch (the router's own dynamic batcher merges client requests): run the
first split, apply the exit rule at every enabled ramp the split computed,
answer the inputs that exit, send the survivors on to the next split, and so
on to the last split, which answers everything left. Decisions live in
:mod:`e3.router.policy`; this file only moves tensors.

The plan arrives in the model config's ``plan`` parameter (JSON, see
:mod:`e3.core.plan`) and is validated against the model card at load; a load
with a malformed plan fails and Triton keeps the running version.
"""

from __future__ import annotations

import json

from e3.core.exits import make_exit_rule
from e3.core.names import ramp_output, state_output
from e3.core.plan import Plan
from e3.core.spec import ModelCard
from e3.export.runtime.triton_io import answer_responses, bls, error_response, gather, model_parameters
from e3.router.policy import BatchRoute


class TritonPythonModel:
    def initialize(self, args):
        _, params = model_parameters(args)
        self.card = ModelCard.from_dict(json.loads(params["model_card"]))
        self.plan = Plan.from_json(params["plan"])
        self.plan.validate(self.card.ramp_blocks)
        if self.plan.num_blocks != self.card.num_blocks:
            raise ValueError(f"plan is for {self.plan.num_blocks} blocks, the model has {self.card.num_blocks}")
        self.rule = make_exit_rule(self.plan.exit_rule)

    def execute(self, requests):
        got = gather(requests, self.card.inputs)
        if not got.valid:
            return got.responses
        L = self.card.num_blocks
        route = BatchRoute(got.rows, self.card.num_classes, L, self.rule)
        feed = got.arrays
        try:
            for split in self.plan.splits:
                ramps = [*split.enabled_ramps, *([L] if split.last_block == L else [])]
                names = ([state_output(t.name) for t in self.card.state] if split.last_block < L else []) + \
                        [ramp_output(k) for k in ramps]
                out = bls(split.model, feed, names)
                keep = route.observe({k: out[ramp_output(k)] for k in ramps})
                if route.done:
                    break
                feed = {t.name: out[state_output(t.name)][keep] for t in self.card.state}
        except RuntimeError as err:
            for i in got.valid:
                got.responses[i] = error_response(f"{self.plan.model} router: {err}")
            return got.responses
        return answer_responses(got, route)
