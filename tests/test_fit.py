"""Cost-model fitting (`rlsched fit`) and fitted cost models (`--cost`): known parameters
recovered from synthetic records, MAPE/R^2, the interpolation fallback, the file round trip,
end to end on a real profile, and bad input (one line, exit 2, nothing written)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pandas as pd
import pytest
from support import ok, rlsched, snapshot

from rlsched.costs.costfile import draft_ms, load_cost_model, prefill_ms, read_cost_file, verify_ms
from rlsched.costs.fit import fit_path, fit_records, mape, r_squared
from rlsched.errors import UserError
from rlsched.traces.writer import TraceWriter

V = dict(t0=2.0, s=0.8, u=0.3, a=0.05, m=3.0, p=3.0, r=0.05, c=3e-4, kv=5e-4)
D = dict(e=0.3, d=1e-4, t0=0.4, a=0.02, m=1.0, p=2.0, c=1e-4, s=0.1)
P = dict(t0=5.0, a=0.04, c=3e-4, g=3e-4, s_c=2e5, h=5e4)  # the bend at 2e5 token pairs (B = 11 x 192 tokens)
F = dict(t0=1.0, a=0.01, c=1e-4, g=1e-4, s_c=2e5, h=5e4)  # the drafter's feed (prefill's form)
BATCHES, CONTEXTS, K_MAX = (1, 2, 4, 8, 16, 32, 64), (64, 192), 6


def _rec(kind, b, k, L, **kw):
    return (
        dict(
            rl_step=0,
            instance=0,
            step=0,
            time_s=0.0,
            kind=kind,
            batch=b,
            drafter="",
            k=k,
            width=1,
            drafted=b * k,
            accepted=0,
            emitted=0,
            draft_ms=0.0,
            verify_ms=0.0,
            step_ms=0.0,
            ctx_tokens=b * L,
        )
        | kw
    )


def profile_records(verify=None, noise=0.01, seed=1) -> pd.DataFrame:
    """A profile's records (STEP schema) generated from the forms with known parameters,
    times lognormal noise; `verify(b, q, L)` replaces the verify form."""
    rng = np.random.default_rng(seed)
    jitter = lambda: float(np.exp(rng.normal(0, noise)))  # noqa: E731
    verify = verify or (lambda b, q, L: float(verify_ms(V, b, q, L)))
    rows = []
    for L in CONTEXTS:
        for b in BATCHES:
            rows.append(_rec("prefill", b, 0, L, step_ms=float(prefill_ms(P, b * L, b * L * L)) * jitter()))
            rows.append(
                _rec("feed", b, 0, L, drafter="model", step_ms=float(prefill_ms(F, b * L, b * L * L)) * jitter())
            )
            for k in range(K_MAX + 1):
                rows.append(_rec("verify", b, k, L, verify_ms=verify(b, k + 1, L) * jitter()))
                if k:
                    rows.append(
                        _rec("draft", b, k, L, drafter="model", draft_ms=float(draft_ms(D, b, k, L)) * jitter())
                    )
    return pd.DataFrame(rows)


def write_steps(folder, df: pd.DataFrame):
    w = TraceWriter(folder / "traces", "steps", flush_every=len(df))
    for r in df.to_dict("records"):
        w.append(r)
    w.close()
    return folder


@pytest.fixture(scope="module")
def synthetic():
    return fit_records(profile_records())


@pytest.fixture(scope="module")
def zigzag():
    """Verify times that zigzag in q and are flat in batch: no roofline does that, the grid does."""
    return fit_records(profile_records(verify=lambda b, q, L: 5.0 + 3.0 * (q % 2), noise=0.0))


def test_mape_and_r_squared_by_hand():
    assert mape([110.0, 90.0, 100.0], [100.0, 100.0, 100.0]) == pytest.approx(20 / 300)
    assert mape([2.0], [1.0]) == pytest.approx(1.0)
    # y = 1, 2, 3 (mean 2, SS_tot 2); residuals 0, 0, 1 (SS_res 1)
    assert r_squared([1.0, 2.0, 4.0], [1.0, 2.0, 3.0]) == pytest.approx(0.5)
    assert r_squared([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == 1.0


def test_fit_recovers_known_parameters(synthetic):
    v, d, p, f = (synthetic.ops[k] for k in ("verify", "draft:model", "prefill", "feed:model"))
    assert [x.used for x in (v, d, p, f)] == ["parametric"] * 4 and not synthetic.notes
    for name in ("t0", "s", "u", "a", "m", "r", "c"):
        assert v.params[name] == pytest.approx(V[name], rel=0.1), name
    for name in ("t0", "a", "c", "g", "s_c"):
        assert p.params[name] == pytest.approx(P[name], rel=0.1), name
    for name in ("t0", "a", "c"):
        assert f.params[name] == pytest.approx(F[name], rel=0.1), name
    for name in ("e", "d", "c", "s"):  # t0 and m trade off inside a forward's floor: check the floor below
        assert d.params[name] == pytest.approx(D[name], rel=0.15), name
    b = np.array([1.0, 64.0])
    np.testing.assert_allclose(d.predict_ms(b, 3.0, 128.0), draft_ms(D, b, 3, 128), rtol=0.03)
    # 1% noise: the held-out batch sizes (2, 8, 32) are predicted within a few percent
    for op in (v, d, p, f):
        q = op.quality
        assert q["heldout"] == "batch sizes 2, 8, 32" and q["mape_heldout"] < 0.025 and q["r2"] > 0.999
        assert q["points"] == len(op.data) and q["heldout_points"] == 3 * len(op.data) // 7


def test_fallback_to_interpolation_where_the_form_misfits(zigzag):
    res = zigzag
    v = res.ops["verify"]
    assert v.used == "interpolation"
    assert v.quality["mape_heldout"] > 0.05 and v.quality["interp_mape_heldout"] < 1e-9
    assert any("verify" in n and "interpolating over the measured grid" in n for n in res.notes)
    assert res.ops["draft:model"].used == "parametric"
    data = res.to_json()
    assert data["ops"]["verify"]["grid"] and "grid" not in data["ops"]["prefill"]


def test_file_round_trips_into_a_cost_model_equal_to_the_fit(synthetic, zigzag, tmp_path):
    path = tmp_path / "cm.json"
    path.write_text(json.dumps(synthetic.to_json()))
    cm = load_cost_model(path, drafters=["model"])
    v, d, p = synthetic.ops["verify"], synthetic.ops["draft:model"], synthetic.ops["prefill"]
    for b, L in ((1, 50), (3, 100), (48, 300), (200, 1000)):  # on, between and beyond the grid
        assert cm.verify_time(b, 1, b * L) == pytest.approx(float(v.predict_ms(b, 1, L)) / 1e3, rel=1e-12)
        assert isinstance(cm.verify_time(b, 1, b * L), float)
        q = np.arange(1, 8)
        np.testing.assert_allclose(cm.verify_time(b, q, b * L), v.predict_ms(b, q, L) / 1e3, rtol=1e-12)
        k = np.arange(0, 7)
        got = cm.draft_time("model", b, k, b * L)
        assert got[0] == 0.0
        np.testing.assert_allclose(got[1:], d.predict_ms(b, k[1:], L) / 1e3, rtol=1e-12)
        # prefill of b prompts of L tokens each
        assert cm.prefill_time(b * L, b * L * L) == pytest.approx(float(p.predict_ms(b, 1, L)) / 1e3, rel=1e-12)
    assert cm.prefill_time(0) == 0.0
    f = synthetic.ops["feed:model"]  # the drafter's catch-up: prefill's form, its own parameters
    for b, L in ((1, 50), (48, 300)):
        assert cm.drafter_prefill_time("model", b * L, b * L * L) == pytest.approx(
            float(f.predict_ms(b, 1, L)) / 1e3, rel=1e-12
        )
    assert cm.drafter_prefill_time("model", 0) == 0.0
    # a file from before drafters' feeds were profiled prices the catch-up at zero
    old = synthetic.to_json()
    del old["ops"]["feed"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert load_cost_model(tmp_path / "old.json").drafter_prefill_time("model", 1000, 10**5) == 0.0
    ctx = np.array([100, 400, 900])  # the simulator prices a run of steps at once: the context as an array
    np.testing.assert_allclose(cm.verify_time(4, 3, ctx), v.predict_ms(4, 3, ctx / 4) / 1e3, rtol=1e-12)
    np.testing.assert_allclose(cm.draft_time("model", 4, 2, ctx), d.predict_ms(4, 2, ctx / 4) / 1e3, rtol=1e-12)
    # the executor drafts the longest row's k for every drafting row
    assert cm.draft_time_per_row("model", np.array([0, 2, 3]), 300) == pytest.approx(cm.draft_time("model", 2, 3, 300))
    # an interpolated op reads back the measured grid
    path.write_text(json.dumps(zigzag.to_json()))
    cm = load_cost_model(path)
    assert cm.verify_time(4, 3, 4 * 64) == pytest.approx(8e-3) and cm.verify_time(6, 2, 6 * 100) == pytest.approx(5e-3)
    np.testing.assert_allclose(cm.verify_time(4, 3, ctx), 8e-3)


def test_run_folder_records_keep_uniform_steps(tmp_path):
    """A run's decode steps give verify (q = k + 1) and draft times; steps whose rows drafted
    ragged lengths (capped near their budgets) are left out and counted in a note."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(300):
        b, L, k = int(rng.integers(1, 64)), int(rng.integers(20, 400)), int(rng.integers(0, 6))
        row = _rec(
            "decode",
            b,
            k,
            L,
            drafter="model" if k else "off",
            verify_ms=float(verify_ms(V, b, k + 1, L)),
            draft_ms=float(draft_ms(D, b, k, L)) if k else 0.0,
            step=i,
        )
        if i % 10 == 9 and k:
            row["drafted"] -= 1  # one row capped: the step's shape is unknown
            row["verify_ms"] *= 3
        rows.append(row)
        if i % 20 == 0:
            rows.append(_rec("prefill", b, 0, L, step_ms=float(prefill_ms(P, b * L, b * L * L))))
    res = fit_path(write_steps(tmp_path / "run", pd.DataFrame(rows)))
    assert res.source["kind"] == "run" and res.source["records"] == len(rows)
    assert any("drafted ragged lengths" in n for n in res.notes)
    v = res.ops["verify"]
    assert v.quality["heldout"] == "a random 25% of the records" and v.quality["mape_heldout"] < 1e-3
    assert v.quality["interp_mape_heldout"] is None and v.used == "parametric"
    assert res.ops["draft:model"].quality["mape_heldout"] < 1e-3
    assert "draft:off" not in res.ops


def test_speculative_steps_timed_as_a_whole_are_refused_with_the_reason(tmp_path):
    """vLLM's speculative rollouts give one time per interval, draft and verify together: the
    fit names that and what to fit instead (exit 2 through the CLI, nothing written)."""
    rows = [
        _rec(
            "decode",
            20 + i,
            3,
            40,
            drafter="model",
            verify_ms=float("nan"),
            draft_ms=float("nan"),
            step_ms=40.0 + i,
            steps=10,
        )
        for i in range(4)
    ]
    write_steps(tmp_path / "vllm-run", pd.DataFrame(rows))
    proc = rlsched("fit", str(tmp_path / "vllm-run"), "--out", str(tmp_path / "c.json"), cwd=tmp_path)
    assert proc.returncode == 2 and "timed as a whole" in proc.stderr and "policy off" in proc.stderr
    assert not (tmp_path / "c.json").exists()


# ----------------------------------------------------------------------------- bad files


@pytest.mark.parametrize(
    "case,expect",
    [
        ("missing", "does not exist"),
        ("not-json", "is not valid JSON"),
        ("wrong-kind", "is not an rlsched cost model"),
        ("wrong-version", "has version 99, this rlsched reads version 1"),
        ("no-ops", "lacks field 'ops'"),
        ("no-param", "'ops.verify.params.a'"),
        ("negative-param", "'ops.draft.model.params.c'"),
        ("bad-grid", "'ops.verify.grid'"),
        ("unknown-form", "'ops.prefill.form'"),
        ("form-v2", "'roofline-verify-v2', this rlsched knows 'roofline-verify-v3'"),  # before the KV-read term
    ],
)
def test_bad_cost_files_name_the_file_and_the_fault(tmp_path, synthetic, case, expect):
    data, path = synthetic.to_json(), tmp_path / "cm.json"
    write = lambda d: path.write_text(d if isinstance(d, str) else json.dumps(d))  # noqa: E731
    if case == "not-json":
        write('{"kind": "rlsched-costmodel", "version": 1, "ops": {')
    elif case == "wrong-kind":
        write({**data, "kind": "rlsched-policy"})
    elif case == "wrong-version":
        write({**data, "version": 99})
    elif case == "no-ops":
        write({k: v for k, v in data.items() if k != "ops"})
    elif case == "no-param":
        data["ops"]["verify"]["params"].pop("a")
        write(data)
    elif case == "negative-param":
        data["ops"]["draft"]["model"]["params"]["c"] = -1.0
        write(data)
    elif case == "bad-grid":
        data["ops"]["verify"]["used"] = "interpolation"
        write(data)
    elif case == "unknown-form":
        data["ops"]["prefill"]["form"] = "roofline-prefill-v9"
        write(data)
    elif case == "form-v2":
        data["ops"]["verify"]["form"] = "roofline-verify-v2"
        write(data)
    with pytest.raises(UserError) as e:
        read_cost_file(path)
    msg = str(e.value)
    assert str(path) in msg and expect in msg and "\n" not in msg


def test_a_config_drafter_the_file_lacks_is_refused(tmp_path, synthetic):
    path = tmp_path / "cm.json"
    path.write_text(json.dumps(synthetic.to_json()))
    with pytest.raises(UserError, match="no draft fit for drafter.*eagle.*it has: model"):
        load_cost_model(path, drafters=["eagle"])


SMALL_SIM = [
    "-p",
    "default",
    "--set",
    "cluster.instances=1",
    "--set",
    "workload.samples_per_prompt=1",
    "--set",
    "rl.steps=1",
    "--set",
    "workload.prompts=4",
    "--set",
    "cluster.max_batch=4",
    "--set",
    "workload.prompt_len={dist: fixed, value: 40}",
    "--set",
    "workload.response_len={dist: fixed, value: 60}",
]


@pytest.mark.parametrize(
    "command,args,expect",
    [
        ("fit", ["nowhere", "--out", "cm.json"], "fit: 'nowhere' does not exist"),
        ("fit", ["empty", "--out", "cm.json"], "fit: 'empty' holds no step traces"),
        ("fit", ["corrupt", "--out", "cm.json"], "is corrupt or truncated"),
        ("fit", ["prof", "--out", "cm.yaml"], "--out 'cm.yaml' must end in .json"),
        ("fit", ["prof", "--out", "cm.json", "--plot", "fit.svg"], "--plot 'fit.svg' must end in .png or .pdf"),
        ("simulate", [*SMALL_SIM, "--cost", "bad.json", "--out", "sim"], "cost model file"),
        ("simulate", [*SMALL_SIM, "--cost", "v2.json", "--out", "sim"], "has version 2"),
        ("simulate", [*SMALL_SIM, "--cost", "absent.json", "--out", "sim"], "absent.json' does not exist"),
        ("compare", [*SMALL_SIM, "--cost", "bad.json", "--out", "cmp", "--seeds", "1"], "is not valid JSON"),
        (
            "learn",
            ["-p", "eagle-h200-14b", "--cost", "good.json", "--out", "pol.json"],
            "no draft fit for drafter(s) eagle",
        ),
    ],
)
def test_bad_input_through_the_cli(tmp_path, synthetic, command, args, expect):
    (tmp_path / "empty").mkdir()
    write_steps(tmp_path / "prof", profile_records())
    (tmp_path / "corrupt" / "traces" / "steps").mkdir(parents=True)
    (tmp_path / "corrupt" / "traces" / "steps" / "part-00000.parquet").write_bytes(b"PAR1 not really")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "good.json").write_text(json.dumps(synthetic.to_json()))
    (tmp_path / "v2.json").write_text(json.dumps({**synthetic.to_json(), "version": 2}))
    before = snapshot(tmp_path)
    proc = rlsched(command, *args, cwd=tmp_path)
    detail = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, detail
    assert len(proc.stderr.strip().splitlines()) == 1 and expect in proc.stderr, detail
    assert proc.stdout == "" and snapshot(tmp_path) == before, detail


# ----------------------------------------------------------------------------- end to end


def test_fit_a_synthetic_profile_then_simulate_on_it(tmp_path):
    """`rlsched fit` writes the file, the table and the plot; `simulate --cost` prices every
    engine step with the fitted model (step by step equal), not the roofline."""
    write_steps(tmp_path / "prof", profile_records())
    proc = ok(rlsched("fit", "prof", "--out", "out/cm.json", "--plot", "fit.png", "--json", cwd=tmp_path))
    summary = json.loads(proc.stdout)
    assert summary["out"] == "out/cm.json" and set(summary["ops"]) == {"verify", "prefill", "draft:model", "feed:model"}
    assert all(o["used"] == "parametric" and o["mape_heldout"] < 0.025 for o in summary["ops"].values())
    assert "MAPE held-out" in proc.stderr and "verify" in proc.stderr  # the table goes to stderr under --json
    assert (tmp_path / "fit.png").read_bytes()[:4] == b"\x89PNG"
    _simulate_on(tmp_path, tmp_path / "out" / "cm.json")


def test_compare_and_learn_run_on_the_fitted_costs(tmp_path, synthetic):
    """--cost travels to compare's worker processes and into learn's candidates."""
    (tmp_path / "cm.json").write_text(json.dumps(synthetic.to_json()))
    one = ["--policy", "static:2", "--cost", "cm.json", "--json", "--no-baseline"]
    sim = json.loads(ok(rlsched("simulate", *SMALL_SIM, *one, "--out", "sim", cwd=tmp_path)).stdout)
    cmp = json.loads(
        ok(
            rlsched(
                "compare",
                *SMALL_SIM,
                "--policies",
                "static:2",
                "--seeds",
                "1",
                "--workers",
                "2",
                "--cost",
                "cm.json",
                "--json",
                cwd=tmp_path,
            )
        ).stdout
    )
    run = next(r for r in cmp["runs"] if r["policy"] == "static:2")
    assert run["summary"]["generation_s"] == pytest.approx(sim["generation_s"], rel=1e-12)
    assert cmp["config"]["cost_file"] == str(tmp_path / "cm.json")
    learned = json.loads(
        ok(
            rlsched("learn", *SMALL_SIM, "--cost", "cm.json", "--out", "pol.json", "-j", "1", "--json", cwd=tmp_path)
        ).stdout
    )
    pf = json.loads((tmp_path / "pol.json").read_text())
    assert pf["learned_on"]["cost_model"]["kind"] == "fitted"
    again = json.loads(
        ok(
            rlsched(
                "simulate",
                *SMALL_SIM,
                "--policy",
                "table:pol.json",
                "--cost",
                "cm.json",
                "--json",
                "--no-baseline",
                "--out",
                "sim2",
                cwd=tmp_path,
            )
        ).stdout
    )
    assert again["generation_s"] == pytest.approx(learned["generation_s"], rel=1e-9)


def _simulate_on(tmp_path, cm_path):
    roof = json.loads(
        ok(rlsched("simulate", *SMALL_SIM, "--policy", "static:2", "--out", "sim0", "--json", cwd=tmp_path)).stdout
    )
    proc = ok(
        rlsched(
            "simulate",
            *SMALL_SIM,
            "--policy",
            "static:2",
            "--cost",
            str(cm_path),
            "--out",
            "sim1",
            "--json",
            cwd=tmp_path,
        )
    )
    fitted = json.loads(proc.stdout)
    assert "step costs: fitted" in proc.stderr
    assert fitted["generation_s"] != roof["generation_s"]
    cm = load_cost_model(cm_path, drafters=["model"])
    tl = pd.read_parquet(tmp_path / "sim1" / "timeline.parquet").sort_values(["rl_step", "instance", "step"])
    joined = (tl.kind.shift(1) == "prefill") & (tl.instance.shift(1) == tl.instance)  # the drafter catches up
    dec, caught_up = tl[tl.kind == "decode"], joined[tl.kind == "decode"].to_numpy()
    np.testing.assert_allclose(
        dec.verify_ms / 1e3, [cm.verify_time(b, 3, c) for b, c in zip(dec.batch, dec.ctx_tokens)], rtol=1e-9
    )
    draft = np.array([cm.draft_time("model", b, 2, c) for b, c in zip(dec.batch, dec.ctx_tokens)])
    assert caught_up.any() and (dec.draft_ms.to_numpy()[caught_up] / 1e3 > draft[caught_up]).all()
    np.testing.assert_allclose(dec.draft_ms.to_numpy()[~caught_up] / 1e3, draft[~caught_up], rtol=1e-9)
    assert fitted["generation_s"] == pytest.approx(tl.step_ms.sum() / 1e3, rel=1e-9)
    meta = json.loads((tmp_path / "sim1" / "meta.json").read_text())
    assert meta["cost_model"]["kind"] == "fitted" and meta["cost_model"]["file"] == str(cm_path.resolve())


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs the executor extra")
def test_fit_a_real_profile_end_to_end(tmp_path, pair):
    # one thread: on a shared 2-core machine two threads wait on each other (measured: 39 s against 5 s)
    ok(
        rlsched(
            "profile",
            "--batch-sizes",
            "1,4,16",
            "--k-max",
            "3",
            "--contexts",
            "32,96",
            "--repeats",
            "2",
            "--threads",
            "1",
            "--out",
            "prof",
            cwd=tmp_path,
            timeout=1800,
        )
    )
    proc = ok(rlsched("fit", "prof", "--out", "cm.json", "--plot", "fit.pdf", cwd=tmp_path))
    for text in ("verify", "prefill", "draft:model", "feed:model", "MAPE held-out", "batch sizes 4"):
        assert text in proc.stdout
    data = json.loads((tmp_path / "cm.json").read_text())
    assert set(data["ops"]["feed"]) == {"model"}
    assert data["kind"] == "rlsched-costmodel" and data["source"]["kind"] == "profile"
    assert data["ops"]["verify"]["quality"]["points"] == 3 * 4 * 2
    assert data["ops"]["prefill"]["params"]["g"] == 0.0  # 6 points: the cache-spill term stays off
    assert all(np.isfinite(list(data["ops"]["verify"]["params"].values())))
    assert (tmp_path / "fit.pdf").read_bytes()[:4] == b"%PDF"
    _simulate_on(tmp_path, tmp_path / "cm.json")


def test_a_sparse_prefill_is_fitted_without_its_spill_bend():
    from rlsched.costs.costfile import PARAMS

    df = profile_records()
    pre = df[df.kind == "prefill"]
    sparse = pd.concat([df[df.kind != "prefill"], pre[pre.batch.isin([1, 4, 16, 64])]])  # 8 points < 2 x 6 params
    p = fit_records(sparse).ops["prefill"].params
    assert set(p) == set(PARAMS["prefill"]) and p["g"] == 0.0  # the bend's terms frozen, no stray names
    assert p["a"] == pytest.approx(P["a"], rel=0.5)
