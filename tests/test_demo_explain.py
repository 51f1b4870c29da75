"""The lines under `make demo`'s table (e3.cli.demo.explain): the form the planner chose and why, this run's
ratios, the GPU figures kept in docs/data (a range over the batches of one model and mix, read from the file,
not written in code) or that none is kept, and where to read more."""

from __future__ import annotations

import json
from dataclasses import replace

from e3.cli.demo import explain, kept_gpu_limits
from e3.core.plan import COMPACT, CONSTANT, default_plan

RATES = {"bert_ee_router": 470.7, "bert_ee_ee": 488.8, "bert_ee_stock": 247.0}


def _plan(form: str, ranges=((1, 6),)):
    plan = default_plan("bert_ee", 6, list(ranges), exit_rule={"kind": "entropy", "tau_nats": 0.5},
                        ramp_blocks=[1, 2, 3, 4, 5])
    return replace(plan, splits=tuple(replace(s, form=form) for s in plan.splits))


def test_a_compact_plan_says_why_and_this_runs_ratios(tmp_path):
    lines = explain(_plan(COMPACT), RATES, [])
    assert "compact form for this CPU" in lines[0] and "E3 0.96x `bert_ee_ee` and 1.91x stock" in lines[0]
    assert "no GPU run is kept" in lines[1] and "docs/README.md" in lines[-1]
    forced = explain(_plan(CONSTANT, ((1, 2), (3, 6))), RATES, [])
    assert "served constant splits" in forced[0] and "compact form" in forced[0]


def test_the_gpu_line_is_the_range_read_from_the_kept_run(tmp_path):
    run = tmp_path / "docs" / "data" / "h100"
    run.mkdir(parents=True)
    limit = [{"model": "bert-base", "mix": "80-20", "max_batch": b, "stock": 100.0, "ee": 120.0, "e3": e3}
             for b, e3 in ((8, 150.0), (32, 240.0))] + \
            [{"model": "bert-base", "mix": "50-50", "max_batch": 8, "stock": 100.0, "ee": 100.0, "e3": 900.0}]
    (run / "side_by_side.json").write_text(json.dumps({"limit": limit}))
    kept = kept_gpu_limits(tmp_path)
    assert len(kept) == 3
    line = explain(_plan(COMPACT), RATES, kept)[1]
    # the first model and mix's range over its batches, not the best row of any mix (the 50-50 row's 9x)
    assert "on an H100 (bert-base, mix 80-20, batches 8, 32" in line
    assert "1.50-2.40x the stock model and 1.25-2.00x naive early exit" in line and "9.00" not in line
    assert kept_gpu_limits(tmp_path / "nowhere") == []
