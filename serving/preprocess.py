"""``<m>_preprocess``: text in, model inputs out (the front door's first step).

Input ``TEXT`` (BYTES [1] per input, UTF-8). Output the model card's inputs
(``input_ids``, ``attention_mask``: INT64 [max_seq_len]), tokenized exactly as
the training and the PyTorch reference tokenize (:class:`e3.serving.tokenizer.Tokenizer` on the
``tokenizer.json`` the exporter put in this model's version folder):
[CLS] ... [SEP], truncated to ``max_seq_len`` tokens, padded with 0. A request
whose text is not valid UTF-8 gets its own client error; the others are answered.
"""

from __future__ import annotations

import json
import os

from e3.core.rows import request_slices, split_rows
from e3.core.spec import ModelCard, TensorSpec
from e3.serving.tokenizer import TOKENIZER_FILE, TextError, Tokenizer, decode_texts
from e3.serving.triton_io import error_response, gather, model_parameters, tensor_response

TEXT = TensorSpec("TEXT", "BYTES", (1,))


class TritonPythonModel:
    def initialize(self, args):
        _, params = model_parameters(args)
        self.card = ModelCard.from_dict(json.loads(params["model_card"]))
        if self.card.preprocess != "minilm":
            raise ValueError(f"no preprocessing named {self.card.preprocess!r}")
        path = os.path.join(args["model_repository"], args["model_version"], TOKENIZER_FILE)
        with open(path, encoding="utf-8") as f:
            self.tokenizer = Tokenizer(f.read(), self.card.max_seq_len)

    def execute(self, requests):
        got = gather(requests, (TEXT,))
        texts, owners, sizes = [], [], []
        for i, rows, n in zip(got.valid, request_slices(got.sizes), got.sizes):
            try:
                texts += decode_texts(got.arrays["TEXT"][rows])
            except TextError as err:
                got.responses[i] = error_response(str(err), client_error=True)
                continue
            owners.append(i)
            sizes.append(n)
        if texts:
            ids, mask = self.tokenizer(texts)
            for i, part in zip(owners, split_rows({"input_ids": ids, "attention_mask": mask}, sizes)):
                got.responses[i] = tensor_response(part)
        return got.responses
