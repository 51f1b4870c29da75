"""The text front door's tokenizer: a WordPiece ``tokenizer.json`` -> (input_ids, attention_mask).

The one tokenizing code: the ``<m>_preprocess`` model runs it on the
``tokenizer.json`` the exporter put beside it, and training and the PyTorch
reference run it on the same file read from the model's package
(:class:`e3.models.data.text.Tokenizer`), so served inputs are tokenized
exactly as in training: [CLS] ... [SEP], truncated to ``max_seq_len`` tokens,
padded with 0.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

__all__ = ["Tokenizer", "TOKENIZER_FILE", "TextError", "decode_texts"]

# The file name of the tokenizer in a ``<m>_preprocess`` version folder: the exporter writes it, the
# model reads it. Here, not in preprocess.py, so the exporter can name it outside Triton's stub.
TOKENIZER_FILE = "tokenizer.json"


class TextError(ValueError):
    """Text the front door refuses (not UTF-8); the message names the input and the byte."""


def decode_texts(raw: np.ndarray) -> list[str]:
    """BYTES tensor [N, 1] -> N strings; raises TextError naming the first input that is not UTF-8.

    Decision: invalid UTF-8 is refused, never repaired with replacement characters
    (the model would answer a text the client did not send).
    """
    texts = []
    for i, item in enumerate(raw.reshape(-1)):
        try:
            texts.append(item.decode("utf-8") if isinstance(item, bytes) else str(item))
        except UnicodeDecodeError as err:
            raise TextError(f"input {i}: text is not valid UTF-8 ({err.reason} at byte {err.start})") from None
    return texts


class Tokenizer:
    """WordPiece texts -> (input_ids, attention_mask), INT64 [N, max_seq_len].

    Text longer than ``max_seq_len`` tokens (with [CLS] and [SEP]) is truncated
    from the end: the first ``max_seq_len - 2`` word pieces are kept and [SEP]
    closes the sequence, as the reference tokenizer of training does (the
    ``tokenizers`` library's longest-first truncation of a single sequence).
    Nothing is refused for its length: :meth:`lengths` tells how long it was.
    """

    def __init__(self, tokenizer_json: str, max_seq_len: int):
        self._tok = HFTokenizer.from_str(tokenizer_json)
        self.max_seq_len = max_seq_len
        self._tok.enable_truncation(max_length=max_seq_len)
        self._tok.enable_padding(length=max_seq_len, pad_id=0, pad_token="[PAD]")

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        encodings = self._tok.encode_batch(list(texts))
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        return ids, mask

    def lengths(self, texts: list[str]) -> np.ndarray:
        """Untruncated token counts (with [CLS]/[SEP])."""
        self._tok.no_truncation()
        try:
            return np.array([len(e.ids) - e.ids.count(0) for e in self._tok.encode_batch(list(texts))])
        finally:
            self._tok.enable_truncation(max_length=self.max_seq_len)
