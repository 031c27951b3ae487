"""The same seed gives the same numbers, where README.md says it does: `simulate` and
`compare` byte for byte (but the output path and creation time in summary.json and meta.json);
`generate` and `run` with policies that read no wall-clock time (and `run` with the `every`
drafter-update schedule) in every column but the timings. Each check runs the real CLI twice."""

import json

import pytest

pytest.importorskip("torch")

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from support import ok, rlsched  # noqa: E402

from rlsched.traces.reader import read_trace  # noqa: E402

pytestmark = pytest.mark.e2e  # the CLI in subprocesses: `make test`, not `make test-fast`

SIM = ["--preset", "default", "--set", "workload.prompts=8", "--set", "rl.steps=1"]


def _decisions(frame: pd.DataFrame) -> pd.DataFrame:
    """A trace without its timing columns: what was decided and what came of it."""
    timing = [c for c in frame.columns if c.endswith(("_s", "_ms")) or c == "tokens_per_s"]
    return frame.drop(columns=timing).reset_index(drop=True)


def _same_traces(a, b, kinds) -> None:
    for kind in kinds:
        ta, tb = (_decisions(read_trace(o / "traces", kind)) for o in (a, b))
        assert len(ta) > 0, kind
        pd.testing.assert_frame_equal(ta, tb, obj=kind)


def test_simulate_and_compare_repeat_byte_for_byte(tmp_path):
    outs = []
    for name in ("a", "b"):
        sim, cmp = tmp_path / f"sim-{name}", tmp_path / f"cmp-{name}"
        ok(rlsched("simulate", *SIM, "--policy", "goodput", "--out", str(sim), "--json", cwd=tmp_path))
        policies = ["--policies", "off,static:2,goodput", "--seeds", "2"]
        ok(rlsched("compare", *SIM, *policies, "--out", str(cmp), cwd=tmp_path))
        outs.append((sim, cmp))
    (sim_a, cmp_a), (sim_b, cmp_b) = outs
    files = sorted(p.name for p in sim_a.iterdir())
    assert "timeline.parquet" in files and files == sorted(p.name for p in sim_b.iterdir())
    for name in files:
        if name not in ("summary.json", "meta.json"):
            assert (sim_a / name).read_bytes() == (sim_b / name).read_bytes(), name
    for name, varies in (("summary.json", "out"), ("meta.json", "created_utc")):
        a, b = (json.loads((o / name).read_text()) for o in (sim_a, sim_b))
        assert varies in a and varies in b, name
        a.pop(varies), b.pop(varies)
        assert a == b, name
    for name in ("compare.json", "compare.parquet"):
        assert (cmp_a / name).read_bytes() == (cmp_b / name).read_bytes(), name


def _generate(tmp_path, out, seed: int):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "count 3 to 9="}\n{"prompt": "rev abcdef="}\n{"prompt": "add 12+34="}\n')
    args = ["--prompts", str(prompts), "--n", "2", "--max-tokens", "16", "--max-batch", "4", "--k-max", "3"]
    ok(rlsched("generate", *args, "--policy", "static:2", "--seed", str(seed), "--out", str(out), cwd=tmp_path))
    return pd.read_parquet(out / "samples.parquet")


def test_generate_with_a_static_policy_repeats_its_samples_and_steps(pair, tmp_path):
    a = _generate(tmp_path, tmp_path / "a", 0)
    b = _generate(tmp_path, tmp_path / "b", 0)
    assert len(a) == 6
    pd.testing.assert_frame_equal(a.drop(columns="finish_s"), b.drop(columns="finish_s"))  # log-probs too, exactly
    _same_traces(tmp_path / "a", tmp_path / "b", ("steps", "samples"))
    other = _generate(tmp_path, tmp_path / "c", 1)
    assert other.token_ids.map(list).tolist() != a.token_ids.map(list).tolist()  # the seed is what fixes them


RUN = """
steps: 2
policy: {policy}
cost_model: {cost}
checkpoint_every: 10
data: builtin:count,repeat
rollout: {{prompts_per_step: 2, group_size: 4, max_tokens: 16, max_batch: 8, k_max: 3}}
algorithm: {{minibatches: 1}}
drafter_update: {{every: 1, steps: 2, batch: 8, schedule: every}}
"""


def _run(tmp_path, out, policy: str, cost: str = "auto"):
    config = tmp_path / f"{out.name}.yaml"
    config.write_text(RUN.format(policy=policy, cost=cost))
    ok(rlsched("run", "--config", str(config), "--out", str(out), "--json", cwd=tmp_path, timeout=1800))
    return out


def _same_run(a, b) -> None:
    """The same rollouts (texts, rewards), engine steps (k, accepted tokens), RL-step numbers
    (losses, the drafter's KL) and final weights, timings aside."""
    for step in range(2):
        name = f"rollouts/step-{step:06d}.parquet"
        ra, rb = pd.read_parquet(a / name), pd.read_parquet(b / name)
        assert len(ra) == 8
        pd.testing.assert_frame_equal(ra, rb, obj=name)
    _same_traces(a, b, ("steps", "samples", "rl_steps"))
    assert read_trace(a / "traces", "rl_steps").drafter_kl_before.notna().any()  # the drafter was distilled
    ck_a, ck_b = (torch.load(o / "checkpoint.pt", weights_only=False) for o in (a, b))
    for part in ("actor", "drafter"):
        for name, t in ck_a[part].items():
            assert torch.equal(t, ck_b[part][name]), (part, name)


@pytest.mark.slow
def test_run_with_a_static_policy_and_the_every_schedule_repeats(pair, tmp_path):
    _same_run(_run(tmp_path, tmp_path / "a", "static:2"), _run(tmp_path, tmp_path / "b", "static:2"))


@pytest.mark.slow
def test_run_priced_by_an_earlier_runs_profile_repeats_it(pair, tmp_path):
    """twostate solves its switch point over the cost model once and reads no step times: a
    rerun priced by the first run's start-up profile (its folder as cost_model) decides alike."""
    first = _run(tmp_path, tmp_path / "first", "twostate")
    assert (first / "profile.parquet").is_file()
    _same_run(first, _run(tmp_path, tmp_path / "rerun", "twostate", cost=str(first)))
