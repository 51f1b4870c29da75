"""``<m>_preprocess``: text in, model inputs out (the front door's first step).

Input ``TEXT`` (BYTES [1] per input, UTF-8). Output the model card's inputs
(``input_ids``, ``attention_mask``: INT64 [max_seq_len]), tokenized exactly as
the training and the PyTorch reference tokenize (:class:`e3.export.data.text.Tokenizer`):
[CLS] ... [SEP], truncated to ``max_seq_len`` tokens, padded with 0. A request
whose text is not valid UTF-8 gets its own error; the others are answered.
"""

from __future__ import annotations

import json

import numpy as np

from e3.core.spec import ModelCard, TensorSpec
from e3.export.runtime.triton_io import InputError, error_response, gather, model_parameters, tensor_response

TEXT = TensorSpec("TEXT", "BYTES", (1,))


def decode_texts(raw: np.ndarray) -> list[str]:
    """BYTES tensor [N, 1] -> N strings; raises InputError naming the first bad input."""
    texts = []
    for i, item in enumerate(raw.reshape(-1)):
        try:
            texts.append(item.decode("utf-8") if isinstance(item, bytes) else str(item))
        except UnicodeDecodeError as err:
            raise InputError(f"input {i}: text is not valid UTF-8 ({err.reason} at byte {err.start})") from None
    return texts


class TritonPythonModel:
    def initialize(self, args):
        from e3.export.data.text import Tokenizer
        _, params = model_parameters(args)
        self.card = ModelCard.from_dict(json.loads(params["model_card"]))
        if self.card.preprocess != "minilm":
            raise ValueError(f"no preprocessing named {self.card.preprocess!r}")
        self.tokenizer = Tokenizer(self.card.max_seq_len)

    def execute(self, requests):
        got = gather(requests, (TEXT,))
        texts, owners = [], []
        for j, i in enumerate(got.valid):
            start = sum(got.sizes[:j])
            try:
                texts += decode_texts(got.arrays["TEXT"][start:start + got.sizes[j]])
                owners.append(i)
            except InputError as err:
                got.responses[i] = error_response(str(err))
        if texts:
            ids, mask = self.tokenizer(texts)
            row = 0
            for i in owners:
                n = got.sizes[got.valid.index(i)]
                got.responses[i] = tensor_response({"input_ids": ids[row:row + n], "attention_mask": mask[row:row + n]})
                row += n
        return got.responses
