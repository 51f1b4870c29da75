"""Input policy (issue: reliability, item 3): NaN/Inf and out-of-range values are refused with a client
error naming the input and the allowed range; over-long text is truncated as documented; non-UTF-8
text is refused. Pure checks first, then the same requests against the real server."""

from __future__ import annotations

import numpy as np
import pytest

from e3.core.spec import ModelCard, TensorSpec
from e3.serving.input_policy import InputError, check_request, check_tensor
from e3.serving.tokenizer import TextError, decode_texts

IDS = TensorSpec("input_ids", "INT64", (4,), (0, 511))
MASK = TensorSpec("attention_mask", "INT64", (4,), (0, 1))
HIDDEN = TensorSpec("hidden", "FP32", (4, 2))


def _ok(n=3):
    return {"input_ids": np.ones((n, 4), np.int64), "attention_mask": np.ones((n, 4), np.int64)}


def test_a_valid_request_passes_and_reports_its_batch():
    assert check_request((IDS, MASK), _ok(3)) == 3
    check_tensor(HIDDEN, np.zeros((2, 4, 2), np.float32))


@pytest.mark.parametrize("value, row", [(512, 1), (-1, 2), (10**12, 0)])
def test_token_ids_outside_the_vocabulary_are_named_with_the_range(value, row):
    arrays = _ok()
    arrays["input_ids"][row, 2] = value
    with pytest.raises(InputError, match=rf"input 'input_ids': value {value} in row {row} is outside "
                                         r"the allowed range \[0, 511\]"):
        check_request((IDS, MASK), arrays)


def test_a_mask_must_be_zero_or_one():
    arrays = _ok()
    arrays["attention_mask"][0, 0] = 7
    with pytest.raises(InputError, match=r"'attention_mask': value 7 in row 0 .*\[0, 1\]"):
        check_request((IDS, MASK), arrays)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_in_float_inputs_are_refused(bad):
    x = np.zeros((3, 4, 2), np.float32)
    x[2, 1, 0] = bad
    x[2, 3, 1] = bad
    with pytest.raises(InputError, match=r"input 'hidden': 2 NaN or Inf value\(s\), first in row 2; "
                                         r"FP32 inputs must be finite"):
        check_tensor(HIDDEN, x)


def test_missing_disagreeing_and_empty_batches():
    with pytest.raises(InputError, match="missing input 'attention_mask'"):
        check_request((IDS, MASK), {"input_ids": np.ones((1, 4), np.int64), "attention_mask": None})
    arrays = _ok()
    arrays["attention_mask"] = arrays["attention_mask"][:2]
    with pytest.raises(InputError, match=r"disagree on the batch size: \[2, 3\]"):
        check_request((IDS, MASK), arrays)
    with pytest.raises(InputError, match="empty batch"):
        check_request((IDS, MASK), _ok(0))


def test_bounds_travel_with_the_card_and_stay_optional():
    assert TensorSpec.from_dict(IDS.to_dict()) == IDS
    assert "bounds" not in HIDDEN.to_dict() and TensorSpec.from_dict(HIDDEN.to_dict()).bounds is None
    with pytest.raises(ValueError, match="bounds"):
        TensorSpec("x", "INT64", (1,), (3, 2))


def test_the_encoder_card_bounds_its_ids_by_the_vocabulary(tiny_model):
    card = ModelCard.from_dict(tiny_model.card.to_dict())
    ids, mask = card.inputs
    assert ids.bounds == (0, tiny_model.config.vocab_size - 1) and mask.bounds == (0, 1)
    assert card.state_after(2)[1].bounds == (0, 1) and card.state_after(2)[0].bounds is None
    check_request(card.inputs, dict(zip(("input_ids", "attention_mask"),
                                        (x.numpy() for x in tiny_model.example_inputs(16, seed=1)))))


def test_non_utf8_text_is_refused_naming_the_input():
    texts = np.array([[b"fine"], ["caf\u00e9".encode()], [b"\xff\xfebad"]], dtype=object)
    with pytest.raises(TextError, match=r"input 2: text is not valid UTF-8 \(invalid start byte at byte 0\)"):
        decode_texts(texts)
    assert decode_texts(texts[:2]) == ["fine", "caf\u00e9"]


def test_long_text_keeps_its_first_pieces_and_closes_with_sep():
    from e3.models.data.text import Tokenizer
    tok = Tokenizer(8)
    words = " ".join(f"w{i}" for i in range(50))
    ids, mask = tok([words])
    full, _ = Tokenizer(200)([words])
    assert mask.all() and tok.lengths([words])[0] > 8
    assert ids[0, :7].tolist() == full[0, :7].tolist() and ids[0, 7] == 102   # [CLS] + 6 first pieces + [SEP]


# -- the same policy on the real server -------------------------------------------------------------------

def _infer_json(server, model: str, inputs: dict[str, np.ndarray]) -> tuple[int, str]:
    """(HTTP status, body) of a plain KServe v2 JSON infer call."""
    import http.client
    import json
    body = {"inputs": [{"name": k, "shape": list(v.shape), "datatype": "FP32" if v.dtype.kind == "f" else "INT64",
                        "data": [None if np.isnan(x) else x for x in v.reshape(-1).tolist()]
                        if v.dtype.kind == "f" else v.reshape(-1).tolist()} for k, v in inputs.items()]}
    conn = http.client.HTTPConnection(server.host, server.http_port, timeout=30)
    try:
        conn.request("POST", f"/v2/models/{model}/infer", json.dumps(body))
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


@pytest.mark.e2e
@pytest.mark.parametrize("model", ["tiny_ee_router", "tiny_ee_ee", "tiny_ee_split_1-2"])
def test_served_models_refuse_out_of_range_ids_with_a_client_error(server, tiny_model, model):
    ids, mask = (x.numpy() for x in tiny_model.example_inputs(3, seed=2))
    for value in (tiny_model.config.vocab_size, -3):
        bad = ids.copy()
        bad[1, 0] = value
        status, text = _infer_json(server, model, {"input_ids": bad, "attention_mask": mask})
        assert status == 400, text
        assert f"input 'input_ids': value {value} in row 1 is outside the allowed range [0, 511]" in text
    status, text = _infer_json(server, model, {"input_ids": ids, "attention_mask": mask})  # still serving
    assert status == 200, text


@pytest.mark.e2e
def test_a_split_refuses_inf_hidden_states(server, tiny_model):
    from e3.client.sdk import ClientError, E3Client
    card = tiny_model.card
    hidden = np.zeros((2, *card.state[0].shape), np.float32)
    hidden[1, 0, 0] = np.inf
    mask = np.ones((2, card.max_seq_len), np.int64)
    with E3Client(server.http_url) as client:   # binary tensor protocol: the value reaches the model as sent
        with pytest.raises(ClientError, match=r"input 'hidden': 1 NaN or Inf value\(s\), first in row 1"):
            client.infer("tiny_ee_split_3-4", {"hidden": hidden, "attention_mask": mask})
