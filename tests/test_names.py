import pytest

from e3.core.names import (CutError, parse_cuts, parse_split_name, ranges_from_cuts, served_name, split_name,
                           state_output)


def test_served_and_split_names_follow_the_convention():
    assert served_name("bert-ee") == "bert_ee"
    assert served_name("mypkg.models:my_model") == "my_model"
    assert split_name("bert_ee", 1, 2) == "bert_ee_split_1-2"
    assert parse_split_name("bert_ee_split_3-6") == ("bert_ee", 3, 6)
    assert state_output("hidden") == "hidden_out"


@pytest.mark.parametrize("cuts, L, ranges", [
    ("2,4", 6, [(1, 2), (3, 4), (5, 6)]),
    ("", 4, [(1, 4)]),
    (None, 3, [(1, 3)]),
    ([1, 2, 3], 4, [(1, 1), (2, 2), (3, 3), (4, 4)]),
])
def test_cuts_become_block_ranges(cuts, L, ranges):
    assert ranges_from_cuts(parse_cuts(cuts, L), L) == ranges


@pytest.mark.parametrize("cuts, message", [
    ("0", "out of range"), ("6", "out of range"), ("4,2", "increasing order"),
    ("2,2", "repeat"), ("two", "comma-separated"),
])
def test_illegal_cuts_are_named(cuts, message):
    with pytest.raises(CutError, match=message):
        parse_cuts(cuts, 6)


def test_bad_model_name_is_rejected():
    with pytest.raises(ValueError):
        served_name("9lives")


def test_zoo_name_of_a_served_model():
    from e3.core.names import zoo_name_of
    zoo = ["tiny-ee", "bert-ee", "bert-stock", "pabee"]
    assert zoo_name_of("tiny_ee_router", zoo) == "tiny-ee"
    assert zoo_name_of("bert_ee_split_1-3", zoo) == "bert-ee"
    assert zoo_name_of("bert_ee", zoo) == "bert-ee"
    assert zoo_name_of("bert_stock", zoo) == "bert-stock"
    with pytest.raises(ValueError, match="--inputs-from"):
        zoo_name_of("resnet_ee_router", zoo)
