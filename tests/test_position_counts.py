"""Chain steps' counts by draft position: what the engines write (`recorder.position_counts`),
how traces carry them, and the fit reading them as an exact Binomial chain."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import ok, rlsched

from rlsched.analysis.engine import position_curves
from rlsched.executor.engine.recorder import position_counts, step_record
from rlsched.policies.position import sample_accepted
from rlsched.policies.position_fit import fit_drafter
from rlsched.traces.reader import read_trace
from rlsched.traces.schema import POSITION_COLUMNS, STEP_SCHEMA
from rlsched.traces.writer import TraceWriter, to_table, write_table

POS = list(POSITION_COLUMNS)


def test_counts_of_rows_of_different_lengths():
    # rows: (drafts, accepted) = (3, 3), (3, 1), (2, 2), (1, 0), (0, 0)
    got = position_counts([3, 3, 2, 1, 0], [3, 1, 2, 0, 0])
    assert got == dict(
        accepted_by_position=[3, 2, 1],
        tried_by_position=[4, 3, 1],  # position 3: only the first row drafted it with 1, 2 accepted
        drafted_by_position=[4, 3, 2],
    )
    assert position_counts([0, 0], [0, 0]) is None
    assert position_counts([2], [5]) == dict(  # a count past the drafts is capped at them
        accepted_by_position=[1, 1], tried_by_position=[1, 1], drafted_by_position=[1, 1]
    )


def _steps(rng, alpha: float, decay: float, n: int, ragged: bool) -> pd.DataFrame:
    """Step records of chains drawn position by position, with their counts."""
    rows = []
    for s in range(n):
        k = 1 + s % 8
        batch = 4 + s % 5
        dk = np.minimum(rng.integers(1, k + 1, batch), k) if ragged else np.full(batch, k)
        acc = np.minimum(sample_accepted(rng, alpha, k, decay, (batch,)), dk)
        rows.append(
            step_record(0, 0, s, 0.0, "decode", batch, "eagle", k, 1, int(dk.sum()), int(acc.sum()), 0, 1, 1, 2, 9)
            | position_counts(dk, acc)
        )
    return pd.DataFrame(rows)


@pytest.mark.parametrize("alpha,decay", [(0.8, 0.85), (0.6, 0.95)])
def test_counts_recover_the_curve_as_well_as_sums_and_use_ragged_steps(alpha, decay):
    steps = _steps(np.random.default_rng(11), alpha, decay, 1200, ragged=False)
    counts, sums = fit_drafter("eagle", steps), fit_drafter("eagle", steps.drop(columns=POS))
    assert (counts.positions, counts.steps) == (1200, 0) and (sums.positions, sums.steps) == (0, 1200)
    for f in (counts, sums):
        assert abs(f.alpha - alpha) < 3.5 * f.alpha_se and abs(f.decay - decay) < 3.5 * f.decay_se
    # the counts are the finer record: their errors are no larger than the sums'
    assert counts.alpha_se <= sums.alpha_se * 1.01 and counts.decay_se <= sums.decay_se * 1.01

    ragged = _steps(np.random.default_rng(12), alpha, decay, 1200, ragged=True)
    exact, summed = fit_drafter("eagle", ragged), fit_drafter("eagle", ragged.drop(columns=POS))
    assert exact.positions == 1200 and exact.skipped == 0
    assert summed.skipped > 600  # rows of different lengths: no sum to convolve
    assert abs(exact.alpha - alpha) < 3.5 * exact.alpha_se and abs(exact.decay - decay) < 3.5 * exact.decay_se
    # the few uniform steps left to the sums tell the curve no better (NaN: the decay on its bound)
    assert exact.decay_se < 0.02 and not summed.decay_se < exact.decay_se


def test_inconsistent_counts_are_read_as_sums():
    steps = _steps(np.random.default_rng(3), 0.8, 0.9, 40, ragged=False)
    counts = list(steps["accepted_by_position"])
    counts[0] = [9] * len(counts[0])  # above the rows that tried
    steps["accepted_by_position"] = counts
    f = fit_drafter("eagle", steps)
    assert (f.positions, f.steps) == (39, 1)


def test_traces_carry_the_counts_and_old_traces_still_fit(tmp_path):
    prefill = step_record(0, 0, 0, 0.0, "prefill", 4, None, 0, 1, 0, 0, 4, 0, 0, 1, 9)
    chains = _steps(np.random.default_rng(5), 0.8, 0.85, 400, ragged=False)
    steps = pd.concat([pd.DataFrame([prefill]), chains], ignore_index=True)
    # a journaled writer (the engines'): parquet parts and a journal of a part never written
    w = TraceWriter(tmp_path / "new", "steps", flush_every=150, journal=True)
    for rec in steps.to_dict(orient="records"):
        w.append(rec)
    w._journal.close()  # (killed: the last records are in the journal alone)
    parts = sorted((tmp_path / "new" / "steps").glob("part-*"))
    assert [p.suffix for p in parts] == [".parquet", ".parquet", ".jsonl"]
    assert pq.read_schema(parts[0]).field("accepted_by_position").type == pa.list_(pa.int32())
    back = read_trace(tmp_path / "new", "steps")
    assert len(back) == 401 and back.loc[0, "accepted_by_position"] is None
    assert [list(c) for c in back["tried_by_position"][1:]] == list(steps["tried_by_position"][1:])
    new = position_curves(back)["eagle"]
    assert new["positions"] == 400 and new["steps"] == 0

    # a trace written before the columns: read as it was, fitted from the sums
    old = tmp_path / "old" / "steps"
    old.mkdir(parents=True)
    write_table(old / "part-000000.parquet", to_table("steps", steps[STEP_SCHEMA.names]))
    df = read_trace(tmp_path / "old", "steps")
    assert not set(POS) & set(df.columns)
    was = position_curves(df)["eagle"]
    assert was["positions"] == 0 and was["steps"] == 400
    assert abs(was["decay"] - new["decay"]) < 3 * was["decay_se"]
    # old and new parts in one folder: the old part's steps read as sums, the new ones by counts
    write_table(old / "part-000001.parquet", to_table("steps", steps.iloc[1:50]))
    both = position_curves(read_trace(tmp_path / "old", "steps"))["eagle"]
    assert (both["positions"], both["steps"]) == (49, 400)


@pytest.mark.e2e
def test_generate_writes_counts_consistent_with_each_step(pair, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "count 3 to 9="}\n{"prompt": "rev abcdef="}\n{"prompt": "sort 5 3 8 1="}\n')
    out = tmp_path / "gen"
    args = ["--n", "4", "--max-tokens", "8", "--max-batch", "8", "--k-max", "4", "--out", str(out)]
    ok(rlsched("generate", "--prompts", str(prompts), "--policy", "static:4", *args, cwd=tmp_path))
    steps = read_trace(out / "traces", "steps")
    chain = steps[steps["drafted"] > 0]
    assert len(chain) and steps[steps["drafted"] == 0]["accepted_by_position"].isna().all()
    capped = 0
    for _, s in chain.iterrows():
        c, t, d = (np.asarray(s[n]) for n in ("accepted_by_position", "tried_by_position", "drafted_by_position"))
        assert len(c) == len(t) == len(d) <= s["k"] == 4
        assert c.sum() == s["accepted"] and d.sum() == s["drafted"] and t[0] == d[0] <= s["batch"]
        assert np.all(np.diff(c) <= 0) and np.all(c <= t) and np.all(t <= d) and np.all(t[1:] <= c[:-1])
        capped += d[-1] < d[0]
    assert capped > 0  # rows near their budget drafted fewer: the counts still hold them
    curve = position_curves(steps)["model"]
    assert curve["positions"] == len(chain) and curve["steps"] == 0 and 0 < curve["alpha"] < 1
