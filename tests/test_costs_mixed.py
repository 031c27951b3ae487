"""Mixed steps (decode/verify rows beside prompt chunks) and the host's per-step part in the
fitted and measured cost models, and `rlsched fit` learning them from step records."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from rlsched.costs.costfile import FittedCostModel, load_cost_model, prefill_ms, verify_ms
from rlsched.costs.fit import fit_records
from rlsched.costs.measured import MeasuredCostModel
from rlsched.errors import UserError

VERIFY = {"t0": 4.0, "s": 0.3, "u": 0.1, "a": 0.002, "m": 2.0, "p": 2.0, "r": 0.01, "c": 1e-6, "kv": 2e-6}
PREFILL = {"t0": 5.0, "a": 0.004, "c": 1e-7, "g": 0.0, "s_c": 1.0, "h": 1.0}
CHUNKS = {"t0": 0.8, "a": 0.003, "c": 2e-7}  # what prompt chunks add to a step's rows (ms)


def _entry(form: str, params: dict) -> dict:
    return {"used": "parametric", "form": form, "params": params, "quality": {}}


def _chunks_ms(p: dict, n, sq):
    return p["t0"] + p["a"] * np.asarray(n, dtype=float) + p["c"] * np.asarray(sq, dtype=float) / 2


def _data(mixed: dict | None = None, host: float | None = None) -> dict:
    ops = {
        "verify": _entry("roofline-verify-v3", VERIFY),
        "prefill": _entry("roofline-prefill-v2", PREFILL),
        "draft": {},
    }
    if mixed is not None:
        ops["mixed"] = _entry("verify-plus-chunks-v2", mixed)
    if host is not None:
        ops["host"] = _entry("host-step-v1", {"step": host, "hook": 0.0})
    return {"kind": "rlsched-costmodel", "version": 1, "ops": ops}


@pytest.mark.parametrize("mixed", [None, CHUNKS])
def test_fitted_mixed_is_verify_without_chunks_and_prefill_without_rows(mixed):
    cost = FittedCostModel(_data(mixed))
    none = np.zeros(0)
    assert cost.mixed_time(16, 3.0, 16 * 500, none, none) == pytest.approx(cost.verify_time(16, 3.0, 16 * 500))
    chunks = np.array([300, 200])
    assert cost.mixed_time(0, 1.0, 0, np.zeros(2), chunks) == pytest.approx(
        cost.prefill_time(500, int((chunks**2).sum())), rel=1e-9
    )


def test_fitted_mixed_is_the_rows_verify_plus_the_chunks_part():
    cost = FittedCostModel(_data(CHUNKS))
    v = cost.verify_time(16, 2.0, 16 * 400)
    m = cost.mixed_time(16, 2.0, 16 * 400, np.zeros(1), np.array([512]))
    assert m == pytest.approx(v + _chunks_ms(CHUNKS, 512, 512**2) / 1e3)
    assert v < m < v + cost.prefill_time(512, 512**2)
    # without a fitted entry the per-step constant (min of the two t0) is paid once
    plain = FittedCostModel(_data()).mixed_time(16, 2.0, 16 * 400, np.zeros(1), np.array([512]))
    p = cost.prefill_time(512, 512**2)
    assert plain == pytest.approx(v + p - min(VERIFY["t0"], PREFILL["t0"]) / 1e3)


def test_a_chunk_after_cached_tokens_costs_its_attention_over_them():
    for data, expected in (
        (_data(CHUNKS), CHUNKS["c"] * 256 * 2 * 4096 / 2 / 1e3),
        (_data(), (prefill_ms(PREFILL, 256, 256 * (256 + 2 * 4096)) - prefill_ms(PREFILL, 256, 256**2)) / 1e3),
    ):
        cost = FittedCostModel(data)
        fresh = cost.mixed_time(8, 1.0, 8 * 300, np.zeros(1), np.array([256]))
        after = cost.mixed_time(8, 1.0, 8 * 300, np.array([4096]), np.array([256]))
        assert after - fresh == pytest.approx(expected)


def test_step_overhead_is_the_per_step_constant_plus_the_host_step():
    assert FittedCostModel(_data()).step_overhead == pytest.approx(4.0e-3)
    cost = FittedCostModel(_data(host=1.5))
    assert cost.step_overhead == pytest.approx(5.5e-3)
    # the host step is charged with every step, once
    assert cost.verify_time(4, 1.0, 400) - FittedCostModel(_data()).verify_time(4, 1.0, 400) == pytest.approx(1.5e-3)
    m = cost.mixed_time(4, 1.0, 400, np.zeros(1), np.array([64]))
    assert m - FittedCostModel(_data()).mixed_time(4, 1.0, 400, np.zeros(1), np.array([64])) == pytest.approx(1.5e-3)


def _profile() -> pd.DataFrame:
    rows = []
    for b in (1, 4, 16):
        for k in (0, 1, 3):
            for ctx in (128, 1024):
                ms = 3.0 + 0.05 * b * (k + 1) + 1e-4 * b * ctx
                rows.append(dict(kind="verify", batch=b, k=k, ctx_tokens=b * ctx, drafter="off", verify_ms=ms))
    for n in (64, 512, 2048):
        rows.append(dict(kind="prefill", batch=1, k=0, ctx_tokens=n, drafter="off", step_ms=2.0 + 0.01 * n))
    return pd.DataFrame(rows).assign(draft_ms=np.nan).fillna({"step_ms": np.nan, "verify_ms": np.nan})


def test_measured_mixed_and_step_overhead():
    cost = MeasuredCostModel(_profile())
    assert cost.step_overhead == pytest.approx(2.0e-3, rel=1e-6)
    none = np.zeros(0)
    assert cost.mixed_time(4, 2.0, 4 * 500, none, none) == pytest.approx(cost.verify_time(4, 2.0, 4 * 500))
    assert cost.mixed_time(0, 1.0, 0, np.zeros(1), np.array([512])) == pytest.approx(cost.prefill_time(512))
    both = cost.mixed_time(4, 2.0, 4 * 500, np.zeros(1), np.array([512]))
    assert both == pytest.approx(cost.verify_time(4, 2.0, 4 * 500) + cost.prefill_time(512) - 2.0e-3, rel=1e-6)


def _synthetic_records(
    gap_ms: float = 0.0, with_prompts: bool = True, prefills=((1, 2, 4, 8, 16), (64, 256, 1024))
) -> pd.DataFrame:
    """A vLLM engine's step records priced by VERIFY, PREFILL (`prefills`: rows and lengths)
    and CHUNKS, `gap_ms` apart on the engine's clock."""
    rng = np.random.default_rng(0)
    rows = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        for k in (0, 1, 2, 4):
            for per in (100, 400, 1600):
                ms = float(verify_ms(VERIFY, b, k + 1, per))
                rows.append(dict(kind="decode", batch=b, k=k, drafted=b * k, ctx_tokens=b * per, verify_ms=ms))
    for n_rows in prefills[0]:
        for length in prefills[1]:
            n = n_rows * length
            ms = float(prefill_ms(PREFILL, n, n * length))
            rows.append(dict(kind="prefill", batch=n_rows, k=0, drafted=0, ctx_tokens=n, verify_ms=ms))
    for _ in range(40):
        b, k, per = int(rng.integers(1, 48)), int(rng.integers(0, 4)), int(rng.integers(100, 2000))
        c = rng.integers(16, 1024, size=int(rng.integers(1, 6)))
        p = rng.choice([0, 512], size=len(c))
        n, sq = int(c.sum()), int((c * (c + 2 * p)).sum())
        ms = float(verify_ms(VERIFY, b, k + 1, per) + _chunks_ms(CHUNKS, n, sq))
        rec = dict(kind="mixed", batch=b, k=k, drafted=b * k, ctx_tokens=b * per, verify_ms=ms)
        if with_prompts:
            rec.update(prompt_tokens=n, prompt_sq=sq)
        rows.append(rec)
    df = pd.DataFrame(rows).assign(rl_step=0, instance=0, width=1, drafter="off", draft_ms=0.0)
    df["step_ms"] = df["verify_ms"]
    df["time_s"] = np.concatenate(([0.0], np.cumsum(df["step_ms"].to_numpy()[:-1] + gap_ms) / 1e3))
    return df


def test_fit_recovers_the_joint_part_of_mixed_steps():
    fit = fit_records(_synthetic_records())
    mixed = fit.to_json()["ops"]["mixed"]
    assert mixed["form"] == "verify-plus-chunks-v2"
    for name, value in CHUNKS.items():
        assert mixed["params"][name] == pytest.approx(value, rel=0.05), name
    assert mixed["quality"]["points"] == 40 and mixed["quality"]["mape"] < 0.01
    for name, value in PREFILL.items():
        if name in ("t0", "a"):
            assert fit.ops["prefill"].params[name] == pytest.approx(value, rel=0.05)
    assert fit.ops["verify"].quality["mape"] < 0.02  # (t0 trades against the floor m: the times, not t0)


def test_mixed_steps_price_chunks_where_prefill_steps_of_one_size_cannot():
    """A vLLM rollout prefills whole prompts in steps of about one size: prefill's fit pins its
    time there and not its slope, so chunks priced by it are far off; the mixed entry's own
    fit prices them from the mixed steps."""
    fit = fit_records(_synthetic_records(prefills=((64,), (13,))))
    mixed = fit.to_json()["ops"]["mixed"]
    assert mixed["quality"]["mape"] < 0.01
    for name in ("t0", "a"):
        assert mixed["params"][name] == pytest.approx(CHUNKS[name], rel=0.05), name


def test_fit_learns_the_host_step_from_gaps_between_records(tmp_path):
    fit = fit_records(_synthetic_records(gap_ms=0.7))
    host = fit.to_json()["ops"]["host"]
    assert host["params"]["step"] == pytest.approx(0.7, abs=1e-6)
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(fit.to_json()))
    cost = load_cost_model(path)
    assert cost.host_step == pytest.approx(0.7e-3, abs=1e-9)
    assert cost.step_overhead == pytest.approx(cost._t0 + 0.7e-3)


def test_mixed_records_without_their_prompt_tokens_are_left_out_with_a_note():
    fit = fit_records(_synthetic_records(with_prompts=False))
    assert "mixed" not in fit.to_json()["ops"]
    assert any("40 mixed steps left out" in n and "prompt_tokens" in n for n in fit.notes)


def test_a_cost_file_with_a_bad_mixed_entry_is_one_clear_error(tmp_path):
    data = _data(CHUNKS)
    data["ops"]["mixed"]["params"]["a"] = -1.0
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"ops\.mixed\.params\.a"):
        load_cost_model(path)
