"""The frontier bench's pure parts (issue 40): ROUGE-L against a brute-force longest common subsequence, the
operating point chosen from a replay table, and the table it writes. No model, no server."""

from __future__ import annotations

import itertools
import random

import pytest

from e3.benchmarks.generation import rouge_l
from e3.benchmarks.generation_frontier import _tau_for_share, format_frontier


def _lcs_brute(a, b) -> int:
    for n in range(min(len(a), len(b)), 0, -1):
        subs = set(itertools.combinations(b, n))
        if any(c in subs for c in itertools.combinations(a, n)):
            return n
    return 0


def test_rouge_l_is_the_f1_of_the_longest_common_subsequence():
    r = random.Random(0)
    for _ in range(60):
        a = [r.randrange(4) for _ in range(r.randint(1, 7))]
        b = [r.randrange(4) for _ in range(r.randint(1, 7))]
        lcs = _lcs_brute(a, b)
        want = 0.0 if not lcs else 2 * (lcs / len(a)) * (lcs / len(b)) / (lcs / len(a) + lcs / len(b))
        assert rouge_l(a, b) == pytest.approx(want), (a, b)
    assert rouge_l([1, 2, 3], [1, 2, 3]) == 1.0 and rouge_l([1], [2]) == 0.0


def test_operating_point_is_the_tau_nearest_the_exit_share():
    table = {"taus": [0.1, 0.5, 0.9, 2.0], "exit_rate": [[0.5, 0.2], [0.1, 0.1], [0.02, 0.01], [0.0, 0.0]]}
    assert _tau_for_share(table, 0.05) == 0.9 and _tau_for_share(table, 0.2) == 0.5
    assert _tau_for_share(table, 0.0) == 0.9   # "never" (2.0) is not an operating point


def test_frontier_table_says_which_points_the_default_takes():
    point = {"set": "general", "point": "softmax tau=0.9", "tokens_per_s": 30.0, "x_full": 0.8,
             "x_full_rounds": [0.8, 0.79, 0.81], "x_full_cpu": 0.82, "per_token_agreement": 0.9, "decoded_agreement": 0.5,
             "rouge_l": 0.6, "exit_share": [0.1, 0.05], "modes": ["calm"], "predicted_x_full": 0.78,
             "default_takes_it": False}
    results = {"settings": {"model": "m", "concurrent": 8}, "budget": "b", "training": None,
               "plain": {"generate()": {"median": 1.0, "ratios": [1.0] * 5, "modes": ["full"], "reason": "why",
                                        "identical_to_full": 8}}, "points": [point]}
    text = format_frontier(results)
    assert "| general | softmax tau=0.9 | 30.0 | 0.80 | 0.80, 0.79, 0.81 | 0.82 | 0.78 | fallback (plain) |" in text
    assert "predicted/served - 1 from -2.5% to -2.5%" in text and "1/1 within 10%" in text
    assert "| `generate()` | full | 1.000 |" in text and '"why"' in text


def test_per_token_agreement_counts_each_choice_given_its_own_prefix():
    """The full model's own greedy text agrees everywhere; one token changed costs that position only, while
    the positional (decoded) agreement with the full text counts every later position the change moved."""
    from e3.benchmarks.generation import agreement, per_token_agreement
    from e3.generation.decoder import tiny_decoder
    from e3.generation.reference import generate_full
    model = tiny_decoder()
    prompt = [3, 1, 4, 1, 5]
    full = generate_full(model, prompt, 8).tokens
    assert per_token_agreement(model, prompt, full) == 1.0
    changed = [full[0], (full[1] + 1) % 64]
    changed += generate_full(model, prompt + changed, 6).tokens   # the full model continues from the change
    assert per_token_agreement(model, prompt, changed) == pytest.approx(7 / 8)
    assert agreement(changed, full) <= 7 / 8


def test_predicted_ratio_follows_the_batch_as_sequences_finish():
    from e3.benchmarks.generation_frontier import predicted_ratio
    from e3.generation.policy import Costs, SplitCost, speedup
    costs = Costs(splits=(SplitCost(1e-2, 1e-3),) * 3, head_s=4e-4, head_fixed_s=8e-3,
                  fills=(SplitCost(1.5e-2, 3e-5), SplitCost(1e-2, 2e-5)))
    same = [32] * 8
    assert predicted_ratio(costs, same, same, [0.0, 0.0], measure="classifier") == pytest.approx(1.0)
    assert predicted_ratio(costs, same, same, [0.1, 0.05], measure="classifier") == pytest.approx(
        speedup(costs, [0.1, 0.05], measure="classifier", batch=8))
    # the same exits, but the early-exit texts end sooner: the tail runs at small batches, where the fixed
    # parts of the calls weigh more per token
    assert predicted_ratio(costs, [32] + [8] * 7, same, [0.0, 0.0], measure="classifier") < 0.9
