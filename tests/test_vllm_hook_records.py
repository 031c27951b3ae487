"""The hook's step records become profile records (no vLLM needed): `calibrate.cost_records`
keeps the swept batch sizes' uniform steps and prices them as MeasuredCostModel reads them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from rlsched.executor.vllm.calibrate import KSweep, cost_records
from rlsched.policies.types import EngineState


def _rec(kind, batch, k, drafted, draft_ms=0.0, verify_ms=0.0, step_ms=0.0, ctx=0):
    return dict(
        rl_step=0,
        instance=0,
        step=0,
        time_s=0.0,
        kind=kind,
        batch=batch,
        drafter="model",
        k=k,
        width=1,
        drafted=drafted,
        accepted=0,
        emitted=batch,
        draft_ms=draft_ms,
        verify_ms=verify_ms,
        step_ms=step_ms or draft_ms + verify_ms,
        ctx_tokens=ctx,
    )


def test_sweep_cycles_k_step_by_step():
    sweep = KSweep("model", 3)
    ks = [sweep.choose(EngineState(0, s, 0.0, np.arange(2), np.full(2, 9), 18, 0, 99, None)).k for s in range(9)]
    assert ks == [0, 1, 2, 3, 0, 1, 2, 3, 0]


def test_cost_records_keep_uniform_steps_of_swept_batches():
    from rlsched.costs.measured import MeasuredCostModel

    sizes, ctx = [1, 4], 100
    records = [_rec("prefill", 1, 0, 0, step_ms=5.0, ctx=90), _rec("prefill", 4, 0, 0, step_ms=9.0, ctx=360)]
    for b in sizes:
        for k in range(3):
            records.append(_rec("decode", b, k, b * k, draft_ms=2.0 * k, verify_ms=10.0 + b + k))
    records += [
        _rec("decode", 3, 2, 6, draft_ms=1, verify_ms=1),  # a batch that began to drain
        _rec("decode", 4, 2, 5, draft_ms=1, verify_ms=1),  # a row capped near its budget
        _rec("mixed", 4, 1, 4, draft_ms=1, verify_ms=1),
    ]
    out = cost_records(records, ctx, sizes)
    kinds = pd.DataFrame(out).groupby("kind").size().to_dict()
    assert kinds == {"prefill": 2, "verify": 6, "draft": 4}
    assert all(r["ctx_tokens"] == r["batch"] * ctx for r in out if r["kind"] != "prefill")
    cost = MeasuredCostModel(pd.DataFrame(out))
    assert cost.verify_time(4, 3, 4 * ctx) == pytest.approx((10 + 4 + 2) / 1e3)
    assert cost.draft_time("model", 1, 2, ctx) == pytest.approx(4.0 / 1e3)
    assert cost.verify_time(4, 1, 4 * ctx) > cost.verify_time(1, 1, ctx)
