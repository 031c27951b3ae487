"""`rlsched replay`: a real run replayed in the simulator. The simulator's engine steps must
be the executor's (closed form under a constant-cost model), and bad input is one line."""

import json

import pytest

pytest.importorskip("torch")

from support import ok, rlsched  # noqa: E402

from rlsched.costs.fit import fit_path  # noqa: E402
from rlsched.traces.reader import read_trace  # noqa: E402

pytestmark = pytest.mark.e2e  # minutes of end-to-end runs: `make test`, not `make test-fast`

TINY = """
steps: 3
checkpoint_every: 3
rollout: {prompts_per_step: 4, group_size: 4, max_tokens: 16, max_batch: 8, k_max: 3}
algorithm: {minibatches: 1}
drafter_update: {every: 0}
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pair):
    root = tmp_path_factory.mktemp("replay")
    (root / "run.yaml").write_text(TINY)
    out = {}
    for label, extra in (("sd", ["--policy", "static:2"]), ("off", ["--policy", "off", "--set", "drafter=off"])):
        out[label] = root / label
        ok(rlsched("run", "--config", str(root / "run.yaml"), *extra, "--out", str(out[label]), cwd=root, timeout=1800))
    return root, out


def test_replay_reports_predicted_against_measured_per_step(runs):
    root, out = runs
    proc = ok(
        rlsched(
            "replay", str(out["sd"]), "--baseline", str(out["off"]), "--plot", str(root / "r.png"), "--json", cwd=root
        )
    )
    s = json.loads(proc.stdout)
    assert s["rl_steps"] == 3 and s["policy"] == "static:2" and s["drafter"] == "model"
    assert s["predicted_generation_s"] > 0 and s["measured_generation_s"] > 0
    # the MAPE is the mean of the 3 steps' |errors|, the worst step the largest of them (how
    # large is this machine's doing: a neighbour's burst during one step of a 3-step run made
    # it 126% once; bench/fidelity.py measures it)
    worst = abs(s["worst_error_pct"])
    assert s["worst_step"] in (0, 1, 2) and worst / 3 - 1e-9 <= s["mape_pct"] <= worst + 1e-9
    # SD at k = 2 on 8 rows: the simulator prices the drafts and the longer verify
    assert s["predicted_off_s"] != pytest.approx(s["predicted_generation_s"])
    assert s["measured_sd_speedup"] > 0 and "speedup_error_pct" in s
    assert (root / "r.png").stat().st_size > 1000


def test_replayed_engine_steps_are_the_executors_under_constant_costs(runs, tmp_path):
    """With every verify costing c and every prefill P, the replay of a run with SD off
    predicts (decode steps) x (c + gap) + (prefills) x (P + gap), plus each rollout's time
    outside its step records: the simulated engine takes exactly the executor's steps (same
    continuous batching, same lengths)."""
    from rlsched.analysis.replay import outside_steps_s

    root, out = runs
    data = fit_path(out["off"]).to_json()
    c_ms, p_ms = 3.0, 5.0
    data["ops"]["verify"].update(used="parametric", params=dict(t0=c_ms, s=0, u=0, a=0, m=0, p=1, r=0, c=0, kv=0))
    data["ops"]["prefill"].update(used="parametric", params=dict(t0=p_ms, a=0, c=0, g=0, s_c=0, h=1))
    cost = tmp_path / "const.json"
    cost.write_text(json.dumps(data))
    s = json.loads(ok(rlsched("replay", str(out["off"]), "--cost", str(cost), "--json", cwd=root)).stdout)
    steps = read_trace(out["off"] / "traces", "steps")
    gap = s["overhead_ms_per_step"]
    n_decode, n_prefill = (steps.kind == "decode").sum(), (steps.kind == "prefill").sum()
    rl = read_trace(out["off"] / "traces", "rl_steps")
    want = (n_decode * (c_ms + gap) + n_prefill * (p_ms + gap)) / 1e3 + len(rl) * outside_steps_s(rl, steps)
    assert s["predicted_generation_s"] == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / "missing", "does not exist"),
        (lambda p: p, "no config.yaml"),
    ],
)
def test_bad_run_folders_are_one_line_exit_2(tmp_path, make, message):
    proc = rlsched("replay", str(make(tmp_path)), cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_corrupt_traces_name_the_file(runs, tmp_path):
    import shutil

    root, out = runs
    broken = tmp_path / "broken"
    shutil.copytree(out["off"], broken)
    part = sorted((broken / "traces" / "rl_steps").glob("part-*"))[0]
    part.write_bytes(b"garbage")
    proc = rlsched("replay", str(broken), cwd=tmp_path)
    assert proc.returncode == 2 and part.name in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "damage, message",
    [
        ("version", "schema version 99"),
        ("columns", "lacks columns"),
        ("truncated", "corrupt or truncated"),
    ],
)
def test_mixed_versions_missing_columns_and_truncation_name_the_file(runs, tmp_path, damage, message):
    import shutil

    import pyarrow.parquet as pq

    root, out = runs
    broken = tmp_path / damage
    shutil.copytree(out["off"], broken)
    part = sorted((broken / "traces" / "steps").glob("part-*.parquet"))[-1]
    table = pq.read_table(part)
    if damage == "version":
        meta = dict(table.schema.metadata)
        meta[b"rlsched.trace"] = json.dumps({"kind": "steps", "version": 99}).encode()
        pq.write_table(table.replace_schema_metadata(meta), part)
    elif damage == "columns":
        pq.write_table(table.drop(["verify_ms"]), part)
    else:
        part.write_bytes(part.read_bytes()[:-200])
    for command in (["replay", str(broken)], ["fit", str(broken), "--out", str(tmp_path / "c.json")]):
        proc = rlsched(*command, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and part.name in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "c.json").exists()


def test_a_run_without_plain_steps_at_its_batch_sizes_gets_a_note():
    """A run's own fit prices SD off by extrapolation when it never decoded plainly at the
    batch sizes it drafted at: the replay says its counterfactual is a guess."""
    import pandas as pd

    from rlsched.analysis.replay import _plain_steps_uncovered

    def steps(rows):
        return pd.DataFrame(rows, columns=["kind", "batch", "k"])

    assert _plain_steps_uncovered(steps([("decode", 8, 2), ("decode", 6, 2), ("decode", 1, 0)]))
    assert _plain_steps_uncovered(steps([("prefill", 8, 0), ("decode", 8, 3)]))
    assert not _plain_steps_uncovered(steps([("decode", 8, 2), ("decode", 8, 0), ("decode", 2, 0)]))
    assert not _plain_steps_uncovered(steps([("decode", 8, 0), ("decode", 1, 0)]))  # no SD at all


def test_a_run_that_profiled_at_its_start_borrows_its_plain_steps(runs, tmp_path):
    """A run that drafted at every batch size has no plain step to fit SD off from; with a
    start-of-run profile (`profile.parquet`) in its folder, the profile's plain steps at 2+
    rows join the fit: a plain step is priced near what plain steps measured, and the note
    says where the prices came from instead of calling the counterfactual a guess."""
    import math
    import shutil

    from rlsched.analysis.replay import _costs, _plain_steps_uncovered

    root, out = runs
    sd = tmp_path / "sd"
    shutil.copytree(out["sd"], sd)
    steps = read_trace(sd / "traces", "steps")
    assert _plain_steps_uncovered(steps)
    # a start-of-run profile as `rlsched run` saves it (a short grid: these are tiny runs)
    ok(
        rlsched(
            "profile",
            "--batch-sizes",
            "1,2,4,8",
            "--k-max",
            "3",
            "--contexts",
            "24",
            "--repeats",
            "5",
            "--passes",
            "1",
            "--out",
            str(tmp_path / "prof"),
            cwd=root,
            timeout=1800,
        )
    )
    profile = read_trace(tmp_path / "prof" / "traces", "steps")
    profile.to_parquet(sd / "profile.parquet")
    plain = profile[(profile.kind == "verify") & (profile.k == 0) & (profile.batch >= 2)]
    cost, what, _, _ = _costs(sd, None, "model", steps)
    assert what["borrowed_plain_steps"] == len(plain) == 3
    # the fit now prices a plain step where the run never took one as the profile measured it
    # (the median log error, within 2x: the run's steps and the profile are timed minutes apart
    # on a shared machine under two test workers, and a fit from a noisy stretch of either was
    # seen 1.7-1.8x off on two of three points)
    err = [
        abs(math.log(cost.verify_time(int(b), 1, float(ctx)) * 1e3 / ms))
        for b, ctx, ms in plain[["batch", "ctx_tokens", "verify_ms"]].itertuples(index=False)
    ]
    assert sorted(err)[len(err) // 2] < math.log(2), err
    s = json.loads(ok(rlsched("replay", str(sd), "--json", cwd=root)).stdout)
    assert s["cost"]["borrowed_plain_steps"] == len(plain)
    assert any("start-of-run profile" in n for n in s["notes"]) and not any("a guess" in n for n in s["notes"])
