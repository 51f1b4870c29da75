"""Glue shared by the project's Python-backend models: parameters, inputs, responses.

Only imported inside Triton's Python-backend stub (it needs
``triton_python_backend_utils``). Requests that cannot be served get their own
error response; the others in the same batch are still answered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

from e3.core.spec import TensorSpec

__all__ = ["InputError", "Gathered", "model_parameters", "io_specs", "gather", "error_response",
           "tensor_response", "answer_responses", "bls"]


class InputError(ValueError):
    """A request this model cannot serve; the message goes back to the client."""


def model_parameters(args: dict) -> tuple[dict, dict[str, str]]:
    """(model config, its string parameters) from ``initialize``'s args."""
    config = json.loads(args["model_config"])
    params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
    return config, params


def io_specs(config: dict, key: str) -> tuple[TensorSpec, ...]:
    """Input or output specs ("input"/"output") of a model config, as TensorSpecs."""
    return tuple(TensorSpec(t["name"], t["data_type"].removeprefix("TYPE_").replace("STRING", "BYTES"),
                            tuple(int(d) for d in t["dims"])) for t in config.get(key, []))


@dataclass
class Gathered:
    arrays: dict[str, np.ndarray]  # inputs of the valid requests, concatenated along the batch
    sizes: list[int]               # rows per valid request
    valid: list[int]               # indices (into requests) of the valid requests
    responses: list                # one slot per request; error responses already filled in

    @property
    def rows(self) -> int:
        return int(sum(self.sizes))


def gather(requests: list, specs: tuple[TensorSpec, ...]) -> Gathered:
    """Concatenate the inputs of ``requests``; reject malformed ones with their own error."""
    parts = {t.name: [] for t in specs}
    sizes, valid, responses = [], [], [None] * len(requests)
    for i, request in enumerate(requests):
        try:
            arrays = {}
            for t in specs:
                tensor = pb_utils.get_input_tensor_by_name(request, t.name)
                if tensor is None:
                    raise InputError(f"missing input '{t.name}'")
                arrays[t.name] = tensor.as_numpy()
            batch = {a.shape[0] if a.ndim else -1 for a in arrays.values()}
            if len(batch) != 1:
                raise InputError(f"inputs disagree on the batch size: {sorted(batch)}")
            n = batch.pop()
            if n <= 0:
                raise InputError("empty batch: the request carries no inputs")
        except InputError as err:
            responses[i] = error_response(str(err))
            continue
        for name, a in arrays.items():
            parts[name].append(a)
        sizes.append(n)
        valid.append(i)
    arrays = {name: np.concatenate(p) if p else np.zeros(0) for name, p in parts.items()}
    return Gathered(arrays, sizes, valid, responses)


def error_response(message: str):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


def tensor_response(outputs: dict[str, np.ndarray]):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, np.ascontiguousarray(v))
                                                      for k, v in outputs.items()])


def answer_responses(got: Gathered, answers) -> list:
    """Fill ``got.responses`` with the front-door answers (DESIGN §2) of each valid request.

    answers: anything with ``label`` [N] int64, ``exit_ramp`` [N] int32 and
    ``probs`` [N, C] float32 over the concatenated batch (a BatchRoute).
    """
    edges = np.cumsum([0, *got.sizes])
    for j, i in enumerate(got.valid):
        rows = slice(edges[j], edges[j + 1])
        got.responses[i] = tensor_response({"label": answers.label[rows, None],
                                            "exit_ramp": answers.exit_ramp[rows, None],
                                            "probs": answers.probs[rows]})
    return got.responses


def bls(model: str, inputs: dict[str, np.ndarray], outputs: list[str], timeout_us: int = 0) -> dict[str, np.ndarray]:
    """Run ``model`` on ``inputs`` through BLS and return the requested ``outputs``.

    Raises RuntimeError with the callee's message if the call fails, so a caller
    can never read outputs of a failed response.
    """
    request = pb_utils.InferenceRequest(
        model_name=model, requested_output_names=outputs,
        inputs=[pb_utils.Tensor(k, np.ascontiguousarray(v)) for k, v in inputs.items()],
        **({"timeout": int(timeout_us)} if timeout_us else {}))
    response = request.exec()
    if response.has_error():
        raise RuntimeError(f"{model}: {response.error().message()}")
    result = {}
    for name in outputs:
        tensor = pb_utils.get_output_tensor_by_name(response, name)
        if tensor is None:
            raise RuntimeError(f"{model}: response lacks output '{name}'")
        result[name] = tensor.as_numpy()
    return result
