"""`--data FILE` for any model (the tests' own model, not a zoo one): e3 evaluate, e3 workload and e3 plan on a
user's .npz; the format's errors name the array; a model in the working directory is importable."""

from __future__ import annotations

import json

import numpy as np
import pytest

from e3.cli import main
from e3.core.exits import make_exit_rule
from e3.core.profile import BatchProfile
from e3.models.reference import reference_answers
from e3.models.user_data import DataError, load_data
from e3.models.zoo import resolve_model
from helpers import synthetic_profile


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    model = resolve_model("custom_ee:summit_patience")
    x = model.example_arrays(200, seed=3)["x"]
    labels = reference_answers(model, (x,), make_exit_rule(model.card.exit_rule)).label   # the model's own answers
    path = tmp_path_factory.mktemp("data") / "summit.npz"
    np.savez(path, x=x, labels=labels)
    return path


def test_the_format_and_its_errors(data_file, tmp_path):
    card = resolve_model("custom_ee:summit").card
    (x,), labels = load_data(data_file, card)
    assert x.shape == (200, 8) and x.dtype == np.float32 and labels.shape == (200,)
    np.savez(tmp_path / "bad.npz", y=x)
    with pytest.raises(DataError, match="has no array 'x'"):
        load_data(tmp_path / "bad.npz", card)
    np.savez(tmp_path / "shape.npz", x=x[:, :5])
    with pytest.raises(DataError, match=r"'x' has shape \[200, 5\], the model takes \[N, 8\]"):
        load_data(tmp_path / "shape.npz", card)
    np.savez(tmp_path / "nolabels.npz", x=x)
    assert load_data(tmp_path / "nolabels.npz", card)[1] is None
    with pytest.raises(DataError, match="no 'labels'"):
        load_data(tmp_path / "nolabels.npz", card, need_labels=True)


def test_evaluate_workload_and_plan_take_a_users_data(data_file, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["evaluate", "custom_ee:summit_patience", "--data", str(data_file), "--out", str(tmp_path / "ev")]) == 0
    out = capsys.readouterr().out
    assert "accuracy 100.00%" in out                     # the labels are the model's own answers
    assert sorted(p.name for p in (tmp_path / "ev").iterdir()) == ["summit_patience.evaluation.json",
                                                                    "summit_patience.evaluation.png"]
    assert main(["workload", "custom_ee:summit_patience", "--data", str(data_file), "--count", "50",
                 "--out", str(tmp_path / "wl")]) == 0
    replay = json.loads((tmp_path / "wl" / "data.json").read_text())
    assert replay["count"] == 200 and replay["enabled_ramps"] == [1, 2, 3]   # what e3 load's comparison names
    assert BatchProfile.load(tmp_path / "wl" / "mix-80-20.batch-profile.json").reach_by_ramps   # measured per set
    synthetic_profile("summit_patience").save(tmp_path / "lat.json")
    assert main(["plan", "--latency-profile", str(tmp_path / "lat.json"), "--model", "custom_ee:summit_patience",
                 "--data", str(data_file), "--devices", "cpu:2", "--slo-ms", "500", "--rate-rps", "50",
                 "--out", str(tmp_path / "plan.json"), "--batch-profile-out", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "batch profile from" in out and "measured for 8 sets of ramps" in out
    batch = BatchProfile.load(tmp_path / "b.json")
    assert batch.exit_rule == {"kind": "patience", "patience": 1} and len(batch.reach_by_ramps) == 8


def test_a_model_in_the_working_directory_is_importable(tmp_path, monkeypatch, capsys):
    (tmp_path / "mymodel_wd.py").write_text("from custom_ee import summit\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    assert main(["evaluate", "mymodel_wd:summit", "--data", "missing.npz"]) == 2
    assert "data file missing.npz does not exist" in capsys.readouterr().err   # got past the import
