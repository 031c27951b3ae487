"""Rollout instances as Ray actors: reallocation moves sequences without losing or duplicating
a token, a killed instance's samples finish elsewhere, new weights reach every instance.

Greedy decoding makes the checks exact: a sequence that migrated (with its KV cache, or
re-prefilled from its tokens) must end exactly as it does on one engine that never moved it.
Every instance runs in its own Ray worker process (a local Ray, started once for the module).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ray = pytest.importorskip("ray")

from support import ok, rlsched  # noqa: E402

from rlsched.executor.decode.drafters import ModelDrafter  # noqa: E402
from rlsched.executor.decode.sampling import GREEDY  # noqa: E402
from rlsched.executor.engine.rollout import RolloutEngine  # noqa: E402
from rlsched.executor.engine.rows import Request  # noqa: E402
from rlsched.executor.pool.instances import InstancePool, InstanceSpec  # noqa: E402
from rlsched.policies.types import Migration  # noqa: E402
from rlsched.traces import read_trace  # noqa: E402

pytestmark = pytest.mark.e2e  # minutes of end-to-end runs: `make test`, not `make test-fast`

V = 16
MAX_BATCH = 8


def long_tail_requests(n_prompts: int = 8, group: int = 3, seed: int = 0, budgets=(6, 10, 40)) -> list[Request]:
    """Prompts whose budgets differ a lot (no eos: each sample runs to its budget)."""
    rng = np.random.default_rng(seed)
    out = []
    for p in range(n_prompts):
        prompt = rng.integers(1, V, size=int(rng.integers(2, 6))).tolist()
        budget = int(rng.choice(budgets))
        for _ in range(group):
            out.append(Request(prompt, p, 1000 + len(out), budget, None))
    return out


def spec_of(tiny, trace_dir=None, policy="static:2") -> InstanceSpec:
    folder = tiny.folder
    return InstanceSpec(
        str(folder),
        "model",
        str(folder),
        GREEDY,
        policy,
        MAX_BATCH * 50,
        MAX_BATCH,
        4,
        64,
        trace_dir=None if trace_dir is None else str(trace_dir),
        threads=1,
    )


def reference(tiny, requests, model=None) -> list[list[int]]:
    """What one engine that never moves a sequence emits (greedy: the plain greedy tokens)."""
    target, drafter = tiny.target, tiny.drafter
    eng = RolloutEngine(
        model or target,
        ModelDrafter(drafter, GREEDY, MAX_BATCH, 64),
        MAX_BATCH * 50,
        MAX_BATCH,
        GREEDY,
        "static:2",
        k_max=4,
    )
    return [s.tokens for s in eng.run(requests).samples]


class MoveHalf:
    """A ReallocPolicy for the test: at instance 0's first event, half of its running
    sequences (the least advanced: the most left to do) go to instance 1 in the given mode."""

    name = "move-half"

    def __init__(self, mode: str):
        self.mode, self.done = mode, False

    def on_event(self, event, cost):
        if self.done or event.instance != 0:
            return []
        v = next(v for v in event.views if v.instance == 0)
        order = np.argsort(v.running_ctx, kind="stable")
        ids = tuple(int(i) for i in v.running_ids[order[: len(order) // 2]])
        if not ids:
            return []
        self.done = True
        return [Migration(0, 1, ids, self.mode)]


@pytest.fixture(scope="module")
def pool(tiny):
    p = InstancePool(
        2, spec_of(tiny), target_state=tiny.target.state_dict(), drafter_state=tiny.drafter.state_dict(), seed=1
    )
    yield p
    p.close()


@pytest.fixture(scope="module")
def ray_address(pool):
    """The address of the Ray cluster the module's pool started: the CLI runs below join it
    through RAY_ADDRESS (as they would a user's cluster) instead of each starting a Ray."""
    return {"RAY_ADDRESS": pool.ray.get_runtime_context().gcs_address}


def check_exactly_once(requests, result, expected):
    assert [s.sample_id for s in result.samples] == [r.sample_id for r in requests]
    for r, s, want in zip(requests, result.samples, expected):
        assert len(s.tokens) == r.max_new_tokens == len(s.logprobs)  # nothing lost, nothing twice
        assert s.tokens == want, f"sample {r.sample_id} differs from the unmoved run"


@pytest.mark.parametrize("mode", ["kv", "reprefill"])
def test_migrated_sequences_lose_and_duplicate_no_token(tiny, pool, mode):
    requests = long_tail_requests()
    pool.realloc = MoveHalf(mode)
    result = pool.run(requests)
    st = result.stats
    assert st["migrated"] > 0, st
    assert st[f"migrated_{mode}"] > 0, st
    check_exactly_once(requests, result, reference(tiny, requests))


def test_rebalance_on_live_states_is_lossless(tiny, pool, tmp_path):
    """The real ReallocPolicy (rebalance, priced by a measured cost model) on the live views."""
    from rlsched.costs.measured import MeasuredCostModel
    from rlsched.executor.pool.moves import HostCost
    from rlsched.executor.profiler import policy_profile
    from rlsched.policies.realloc import make_realloc_policy

    base = MeasuredCostModel(
        policy_profile(tiny.target, None, policy="off", max_batch=MAX_BATCH, k_max=4, typical_ctx=16, sampling=GREEDY)
    )
    pool.cost, pool.threshold = HostCost(base, 256, 1e-3, 1e9), 4
    pool.realloc = make_realloc_policy("rebalance")
    # instance 0 gets every long prompt: uneven loads, with a queue there long enough that the
    # other instance asks for work before it drains, however the machine's load paces the two
    requests = [Request([1 + p, 2, 3], p, p, 40 if p % 2 == 0 else 4, None) for p in range(12) for _ in range(4)]
    result = pool.run(requests)
    assert result.stats["migrated"] > 0, result.stats
    check_exactly_once(requests, result, reference(tiny, requests))


def test_killed_instance_samples_finish_on_the_other(tiny):
    requests = long_tail_requests(seed=3)
    p = InstancePool(2, spec_of(tiny), target_state=tiny.target.state_dict(), drafter_state=tiny.drafter.state_dict())
    killed = []

    def kill_one(i, report):  # instance 1 dies after its first answer, mid-rollout
        if i == 1 and not killed:
            held = len(report["view"]["running_ids"]) + len(report["view"]["waiting_ids"])
            killed.append(held)
            p.kill(1)

    p.on_report = kill_one
    try:
        result = p.run(requests)
        again = p.run(requests)  # the instance was started again: both run the next rollout
    finally:
        p.close()
    assert killed and killed[0] > 0  # it held unfinished samples when it died
    st = result.stats
    assert st["instances_died"] == 1 and st["requeued"] >= killed[0] and p.restarts == [0, 1]
    check_exactly_once(requests, result, reference(tiny, requests))
    assert again.stats["instances_alive"] == 2 and again.stats["instances_died"] == 0
    assert set(again.stats["instance_finish_s"]) == {"0", "1"}
    check_exactly_once(requests, again, reference(tiny, requests))


def test_new_weights_reach_every_instance(tiny, pool):
    target = tiny.target
    changed = type(target)(target.config)
    changed.load_state_dict(target.state_dict())
    with torch.no_grad():
        for prm in changed.parameters():
            prm.add_(0.2 * torch.randn_like(prm))
    requests = long_tail_requests(seed=5)
    pool.realloc = MoveHalf("kv")
    before = pool.run(requests)
    pool.sync_weights(changed)
    after = pool.run(requests)
    want = reference(tiny, requests, model=changed)
    assert [s.tokens for s in before.samples] != want
    check_exactly_once(requests, after, want)
    pool.sync_weights(target)


def test_each_instance_writes_its_own_traces(tiny, tmp_path):
    p = InstancePool(
        2,
        spec_of(tiny, tmp_path / "traces"),
        target_state=tiny.target.state_dict(),
        drafter_state=tiny.drafter.state_dict(),
    )
    p.realloc = MoveHalf("reprefill")
    try:
        requests = long_tail_requests(seed=7, budgets=(24, 40))  # still running when the move lands
        p.run(requests)
    finally:
        p.close()
    samples = read_trace(tmp_path / "traces", "samples")
    steps = read_trace(tmp_path / "traces", "steps")
    assert sorted(samples["sample_id"]) == sorted(r.sample_id for r in requests)
    assert set(samples["instance"]) == {0, 1} and set(steps["instance"]) == {0, 1}
    assert samples["migrations"].sum() > 0
    assert {f.name.split(".")[0].rsplit("-", 1)[1] for f in (tmp_path / "traces" / "steps").iterdir()} == {"i0", "i1"}


def test_generate_with_instances_through_the_cli(tmp_path, ray_address):
    """On a running cluster (RAY_ADDRESS), which refuses a CPU count from a joining driver."""
    out = tmp_path / "gen"
    proc = ok(
        rlsched(
            "generate",
            "--instances",
            "2",
            "--realloc",
            "rebalance",
            "--policy",
            "static:2",
            "--n",
            "2",
            "--max-tokens",
            "24",
            "--out",
            str(out),
            "--json",
            cwd=tmp_path,
            timeout=1800,
            env_extra=ray_address,
        )
    )
    import json

    summary = json.loads(proc.stdout)
    assert summary["instances"] == 2 and summary["samples"] == 64
    import pandas as pd

    df = pd.read_parquet(out / "samples.parquet")
    assert df["sample_id"].is_unique and len(df) == 64
    assert set(read_trace(out / "traces", "samples")["instance"]) == {0, 1}


@pytest.mark.parametrize(
    "args, field",
    [(["--instances", "0"], "--instances"), (["--instances", "2", "--realloc", "shuffle"], "reallocation")],
)
def test_bad_pool_arguments(tmp_path, args, field):
    proc = rlsched("generate", *args, "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert field in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["generate", "run"])
def test_a_ray_address_with_no_cluster_is_one_line_at_once(tmp_path, command):
    """ray.init retries an address where nothing listens for minutes; both commands check it
    before they profile, load or write anything."""
    proc = rlsched(
        command,
        "--instances",
        "2",
        "--out",
        str(tmp_path / "o"),
        cwd=tmp_path,
        timeout=1800,
        env_extra={"RAY_ADDRESS": "127.0.0.1:1"},
    )
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "RAY_ADDRESS" in line and "127.0.0.1:1" in line, line
    assert not (tmp_path / "o").exists()


def test_without_ray_one_line_says_how_to_get_it(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['ray'] = None; from rlsched.cli import main; "
        f"sys.argv = ['rlsched', 'generate', '--instances', '2', '--out', {str(tmp_path / 'o')!r}]; main()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**__import__("os").environ, "COLUMNS": "400"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "distributed" in proc.stderr and "ray" in proc.stderr.lower()
    assert not (tmp_path / "o").exists()


def test_rl_run_on_two_instances_through_the_cli(tmp_path, ray_address):
    """`rlsched run --instances 2 --realloc rebalance`: the rollouts run on two Ray actors
    that get the new weights after every update; the traces hold both instances."""
    out = tmp_path / "run"
    ok(
        rlsched(
            "run",
            "--instances",
            "2",
            "--realloc",
            "rebalance",
            "--policy",
            "static:2",
            "--set",
            "steps=2",
            "--set",
            "rollout.prompts_per_step=4",
            "--set",
            "rollout.group_size=4",
            "--set",
            "rollout.max_tokens=16",
            "--set",
            "checkpoint_every=1",
            "--out",
            str(out),
            cwd=tmp_path,
            timeout=1800,
            env_extra=ray_address,
        )
    )
    rl = read_trace(out / "traces", "rl_steps")
    assert list(rl["rl_step"]) == [0, 1] and "migrated" in rl and (rl["samples"] == 16).all()
    samples = read_trace(out / "traces", "samples")
    assert set(samples["instance"]) == {0, 1}
    assert samples.groupby("rl_step")["sample_id"].apply(lambda s: s.is_unique and len(s) == 16).all()
    assert (out / "checkpoint.pt").is_file() and (out / "summary.json").is_file()


def test_an_instance_dead_before_the_rollout_leaves_its_share_to_the_others(tiny):
    """Instance 0 dies between rollouts: its share is submitted to instance 1 once, not twice."""
    requests = long_tail_requests(seed=11)
    p = InstancePool(2, spec_of(tiny), target_state=tiny.target.state_dict(), drafter_state=tiny.drafter.state_dict())
    try:
        p.kill(0)
        result = p.run(requests)
    finally:
        p.close()
    assert result.stats["instances_died"] == 1 and p.restarts == [1, 0]
    check_exactly_once(requests, result, reference(tiny, requests))


def test_resize_makes_room_for_longer_prompts(tiny, pool):
    spec_capacity = pool.spec.cache_capacity
    requests = [Request([1 + (i % 9)] * 30, i, i, 30, None) for i in range(MAX_BATCH * 2)]  # 60 tokens each
    pool.realloc = MoveHalf("kv")
    pool.resize(MAX_BATCH * 64, 80)
    try:
        check_exactly_once(requests, pool.run(requests), reference(tiny, requests))
    finally:
        pool.resize(spec_capacity, 64)


def _rows_round_trip(model, drafter, requests, with_kv: bool, dtype=torch.float32):
    """Run a few steps, export every running row (through pickle, as Ray ships it), import it
    back into the same engine, finish: what comes out, and the acceptance counts before/after."""
    import pickle

    eng = RolloutEngine(
        model, ModelDrafter(drafter, GREEDY, MAX_BATCH, 64), MAX_BATCH * 50, MAX_BATCH, GREEDY, "static:2", k_max=4
    )
    prompt_of = np.array([r.prompt_id for r in requests])
    eng.begin(prompt_of, max(len(r.prompt) + r.max_new_tokens for r in requests))
    eng.submit(list(enumerate(requests)))
    results = {}
    for _ in range(3):
        results.update(eng.work())
    ids = [int(i) for i in eng.view()["running_ids"]]
    before = {i: eng.estimator.take_sample_counts("model", i) for i in ids}
    for i, (s, f) in before.items():  # put them back: export takes them again
        eng.estimator.add_sample_counts("model", i, s, f)
    moved = pickle.loads(pickle.dumps(eng.export_rows(ids, set(ids) if with_kv else set())))
    assert all((m["kv"] is not None) == with_kv for m in moved)
    assert all(eng.estimator.take_sample_counts("model", i) == (0.0, 0.0) for i in ids)  # they left
    eng.import_rows(moved)
    after = {i: eng.estimator.take_sample_counts("model", i) for i in ids}
    assert after == before  # came back once, counted once
    for i, (s, f) in after.items():
        eng.estimator.add_sample_counts("model", i, s, f)
    while eng.has_work:
        results.update(eng.work())
    return [results[i].tokens for i in range(len(requests))]


@pytest.mark.parametrize("with_kv", [True, False])
def test_a_row_that_leaves_and_comes_back_keeps_its_tokens_and_counts(tiny, with_kv):
    requests = long_tail_requests(n_prompts=3, seed=2, budgets=(24, 40))
    assert _rows_round_trip(tiny.target, tiny.drafter, requests, with_kv) == reference(tiny, requests)


def test_bfloat16_kv_rows_travel(tiny):
    """KV rows leave as CPU tensors of the cache's dtype (numpy has no bfloat16)."""
    from rlsched.executor.model.loading import load_model

    model = load_model(tiny.folder, dtype="bfloat16").model
    drafter = load_model(tiny.folder, dtype="bfloat16").model
    requests = long_tail_requests(n_prompts=3, seed=2, budgets=(24, 40))
    out = _rows_round_trip(model, drafter, requests, with_kv=True)
    assert [len(t) for t in out] == [r.max_new_tokens for r in requests]


def test_instances_on_cuda_need_a_gpu_each(tiny):
    """On a GPU machine each instance gets its own GPU; where Ray sees too few, one clear line."""
    from dataclasses import replace

    from rlsched.errors import UserError

    gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    if gpus >= 2:
        pytest.skip("this machine has the GPUs")
    with pytest.raises(UserError, match=r"2 rollout instances on 'cuda' need 2 GPUs, Ray sees"):
        InstancePool(2, replace(spec_of(tiny), device="cuda"))
