"""`rlsched run` end to end through the entry point, on the built-in pair with a tiny config:
what a run writes, GRPO and PPO, kill -9 then --resume (nothing lost or duplicated, the same
numbers as an uninterrupted run), and bad input (one line, exit 2, nothing lost)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from support import ok, rlsched, snapshot  # noqa: E402

from rlsched.traces.reader import read_trace  # noqa: E402

pytestmark = pytest.mark.e2e  # minutes of end-to-end runs: `make test`, not `make test-fast`

TINY = """
steps: {steps}
policy: static:2
checkpoint_every: 1
data: builtin:count,repeat
rollout: {{prompts_per_step: 4, group_size: 4, max_tokens: 16, max_batch: 16, k_max: 3}}
algorithm: {{minibatches: 1}}
drafter_update: {{every: 2, steps: 2, batch: 8, schedule: every}}
"""


def _config(tmp_path, steps=4, extra=""):
    path = tmp_path / "run.yaml"
    path.write_text(TINY.format(steps=steps) + extra)
    return path


def test_run_writes_traces_rollouts_checkpoint_plot_and_summary(pair, tmp_path):
    out = tmp_path / "run"
    proc = ok(
        rlsched(
            "run", "--config", str(_config(tmp_path, steps=3)), "--out", str(out), "--json", cwd=tmp_path, timeout=1800
        )
    )
    summary = json.loads(proc.stdout)
    assert summary["steps"] == 3 and summary["drafter"] == "model" and summary["policy"] == "static:2"
    rl = read_trace(out / "traces", "rl_steps")
    assert rl.rl_step.tolist() == [0, 1, 2]
    for col in ("generation_s", "inference_s", "training_s", "total_s", "response_tokens"):
        assert (rl[col] > 0).all(), col
    assert (rl.drafter_update_s[rl.rl_step == 1] > 0).all() and (rl.drafter_update_s[rl.rl_step != 1] < 0.05).all()
    assert rl.reward_mean.between(0, 1).all() and (rl.mean_accept_len > 1).all()
    steps = read_trace(out / "traces", "steps")
    samples = read_trace(out / "traces", "samples")
    assert sorted(samples.sample_id) == list(range(3 * 16))  # every sample once
    # per-sample chain trials add up to the steps' (static:2 feeds no estimator: the acceptance
    # column comes from the sample's own trials, not the prior)
    decode_steps = steps[steps.kind == "decode"]
    assert samples.accepted.sum() == decode_steps.accepted.sum() and samples.drafted.sum() == decode_steps.drafted.sum()
    assert (samples.rejected <= samples.drafted).all() and samples.acceptance_model.nunique() > 3
    for s in range(3):
        decode = steps[(steps.rl_step == s) & (steps.kind == "decode")]
        assert decode.emitted.sum() == rl.response_tokens[rl.rl_step == s].item()
        roll = pd.read_parquet(out / "rollouts" / f"step-{s:06d}.parquet")
        assert len(roll) == 16 and roll.reward.isin([0.0, 1.0]).all()
        assert roll.reward.mean() == pytest.approx(rl.reward_mean[rl.rl_step == s].item())
    assert (out / "checkpoint.pt").is_file() and (out / "plots" / "learning_curve.png").stat().st_size > 1000
    ck = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ck["next_step"] == 3
    # a finished run's folder may be reused: it is replaced
    ok(
        rlsched(
            "run", "--config", str(_config(tmp_path, steps=1)), "--out", str(out), "--json", cwd=tmp_path, timeout=1800
        )
    )
    assert read_trace(out / "traces", "rl_steps").rl_step.tolist() == [0]


def test_ppo_runs_with_a_critic(pair, tmp_path):
    (tmp_path / "dense.py").write_text("def length(prompt, response, answer):\n    return len(response) / 10\n")
    out = tmp_path / "ppo"
    ok(
        rlsched(
            "run",
            "--config",
            str(_config(tmp_path, steps=2)),
            "--set",
            "algorithm.name=ppo",
            "--policy",
            "off",
            "--set",
            f"reward={tmp_path}/dense.py:length",
            "--out",
            str(out),
            "--json",
            cwd=tmp_path,
            timeout=1800,
        )
    )
    rl = read_trace(out / "traces", "rl_steps")
    assert (rl.value_loss > 0).all() and (rl.reward_mean > 0).all()
    assert (rl.critic_s > 0).all() and (rl.reference_s > 0).all() and (rl.reward_s > 0).all()
    critic = torch.load(out / "checkpoint.pt", weights_only=False)["critic"]
    assert critic["head.weight"].abs().sum() > 0  # the zero-initialised value head learned
    assert (rl.mean_accept_len == 1.0).all()  # policy off: no speculation


def _final(out):
    rl = read_trace(out / "traces", "rl_steps").sort_values("rl_step")
    cols = ["rl_step", "reward_mean", "response_tokens", "drafted", "accepted", "loss", "drafter_kl_after"]
    return rl[cols].reset_index(drop=True), torch.load(out / "checkpoint.pt", weights_only=False)


def test_kill_9_then_resume_loses_nothing_and_matches_an_uninterrupted_run(pair, tmp_path):
    config = _config(tmp_path, steps=5)
    whole = tmp_path / "whole"
    ok(rlsched("run", "--config", str(config), "--out", str(whole), "--json", cwd=tmp_path, timeout=1800))

    cut = tmp_path / "cut"
    env = dict(os.environ, COLUMNS="400")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlsched", "run", "--config", str(config), "--out", str(cut)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    journal_dir = cut / "traces" / "rl_steps"
    deadline = time.time() + 1800
    while time.time() < deadline:  # kill during the third step (two rl_steps records written)
        lines = sum(p.read_text().count("\n") for p in journal_dir.glob("*.jsonl")) if journal_dir.is_dir() else 0
        if lines >= 2:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (cut / "summary.json").exists()
    # without --resume the unfinished run is refused, untouched
    before = snapshot(cut)
    bad = rlsched("run", "--config", str(config), "--out", str(cut), cwd=tmp_path)
    assert bad.returncode == 2 and "--resume" in bad.stderr and snapshot(cut) == before
    ok(rlsched("run", "--out", str(cut), "--resume", "--json", cwd=tmp_path, timeout=1800))

    a, ck_a = _final(whole)
    b, ck_b = _final(cut)
    assert b.rl_step.tolist() == [0, 1, 2, 3, 4]  # no step lost or duplicated
    pd.testing.assert_frame_equal(a, b)
    for name, t in ck_a["actor"].items():
        assert torch.equal(t, ck_b["actor"][name]), name
    for name, t in ck_a["drafter"].items():
        assert torch.equal(t, ck_b["drafter"][name]), name
    samples = read_trace(cut / "traces", "samples")
    assert sorted(samples.sample_id) == list(range(5 * 16))
    cols = ["rl_step", "step", "kind", "batch", "k", "drafted", "accepted", "emitted"]
    steps_a, steps_b = (read_trace(o / "traces", "steps")[cols].reset_index(drop=True) for o in (whole, cut))
    pd.testing.assert_frame_equal(steps_a, steps_b)  # every engine step once, as uninterrupted


def test_reward_failures_are_counted_then_stop_the_run_past_the_threshold(pair, tmp_path):
    (tmp_path / "flaky.py").write_text(
        "def some(prompt, response, answer):\n"
        "    if prompt.startswith('repeat') and len(response) % 7 == 3:\n"
        "        raise ValueError('cannot score this one')\n"
        "    return float(response == answer)\n"
        "def always(prompt, response, answer):\n"
        "    raise RuntimeError('the reward server is down')\n"
    )
    out = tmp_path / "flaky"
    proc = ok(
        rlsched(
            "run",
            "--config",
            str(_config(tmp_path, steps=2)),
            "--set",
            f"reward={tmp_path}/flaky.py:some",
            "--set",
            "max_reward_failures=1.0",
            "--out",
            str(out),
            "--json",
            cwd=tmp_path,
            timeout=1800,
        )
    )
    rl = read_trace(out / "traces", "rl_steps")
    roll = pd.concat(pd.read_parquet(p) for p in sorted((out / "rollouts").glob("*.parquet")))
    assert rl.reward_failures.sum() == roll.reward_failed.sum()
    assert json.loads(proc.stdout)["steps"] == 2

    out = tmp_path / "down"
    proc = rlsched(
        "run",
        "--config",
        str(_config(tmp_path, steps=3)),
        "--set",
        f"reward={tmp_path}/flaky.py:always",
        "--out",
        str(out),
        cwd=tmp_path,
        timeout=1800,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "failed on 16 of 16 samples at step 0" in proc.stderr and "the reward server is down" in proc.stderr
    assert "--resume" in proc.stderr
    assert (out / "config.yaml").is_file() and not (out / "summary.json").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "rollout.group_size=0"], "rollout.group_size"),
        (["--set", "rollout.probe_every=0"], "rollout.probe_every"),
        (["--set", "drafter_update.schedule=sometimes"], "drafter_update.schedule"),
        (["--set", "algoritm.lr=1"], "unknown field 'algoritm'"),
        (["--set", "data=missing.jsonl"], "missing.jsonl"),
        (["--set", "reward=nosuchmodule:fn"], "nosuchmodule"),
        (["--policy", "bogus"], "bogus"),
        (["--policy", "seqgoodput:drain"], "seqgoodput:drain"),  # refused before the auto profile
        (["--set", "model=/no/such/model"], "/no/such/model"),
        (["--policy", "goodput", "--set", "cost_model=/no/such/profile"], "cost_model: /no/such/profile is neither"),
        # in the run's words, and before any model is loaded (the model folder does not exist)
        (["--policy", "static:9", "--set", "model=/no/such/model"], "K = 9 is above rollout.k_max = 3"),
        (
            ["--policy", "static:2", "--set", "drafter=off", "--set", "model=/no/such/model"],
            "drafter is off; set drafter",
        ),
        (
            ["--set", "rollout.width_max=2", "--set", "rollout.backend=vllm", "--set", "model=/no/such/model"],
            "rollout.width_max 2: draft trees run on the local engine only",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(pair, tmp_path, args, message):
    out = tmp_path / "bad"
    proc = rlsched("run", "--config", str(_config(tmp_path, steps=1)), *args, "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not out.exists()


def test_resume_of_a_folder_without_a_run_is_refused(tmp_path):
    proc = rlsched("run", "--out", str(tmp_path), "--resume", cwd=tmp_path)
    assert proc.returncode == 2 and "holds no run" in proc.stderr


def test_a_reward_model_folder_scores_the_samples(pair, tmp_path):
    import transformers

    from rlsched.executor.model.builtin import write_tokenizer

    folder = tmp_path / "rm"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=0,
    )
    transformers.LlamaForSequenceClassification(config).save_pretrained(folder)
    write_tokenizer(folder, 64)
    out = tmp_path / "rm-run"
    ok(
        rlsched(
            "run",
            "--config",
            str(_config(tmp_path, steps=1)),
            "--set",
            f"reward=model:{folder}",
            "--out",
            str(out),
            "--json",
            cwd=tmp_path,
            timeout=1800,
        )
    )
    roll = pd.read_parquet(out / "rollouts" / "step-000000.parquet")
    assert roll.reward.notna().all() and roll.reward.nunique() > 4  # real scores, not 0/1


def test_a_policy_file_learned_for_another_model_is_refused(pair, tmp_path):
    """A table learned in the simulator for qwen2.5-7b does not run on the built-in pair: exit
    2, one line, nothing written; the same table learned for the pair's architecture runs."""
    from rlsched.config import load_config
    from rlsched.executor.model.loading import load_config as model_config
    from rlsched.sim.learn import Learner

    cfg = load_config(
        "default", overrides=["workload.prompts=16", "rl.steps=1", "model=qwen2.5-7b", "speculation.k_max=3"]
    )
    pf, _ = Learner(cfg, [0], evaluate=lambda jobs: [1.0] * len(jobs), log=lambda *_: None).learn("table")
    data = json.loads(pf.model_dump_json())
    assert data["learned_on"]["model_shape"]["hidden"] == 3584
    other = tmp_path / "qwen.json"
    other.write_text(json.dumps(data))
    out = tmp_path / "bad"
    proc = rlsched(
        "run",
        "--config",
        str(_config(tmp_path, steps=1)),
        "--policy",
        f"table:{other}",
        "--out",
        str(out),
        cwd=tmp_path,
        timeout=1800,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "was learned for another model" in proc.stderr and "hidden 3584" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
    mine = tmp_path / "mine.json"  # as if learned on costs fitted to the pair: its shape recorded
    data["learned_on"]["model_shape"] = model_config(pair.target).shape
    mine.write_text(json.dumps(data))
    out = tmp_path / "good"
    ok(
        rlsched(
            "run",
            "--config",
            str(_config(tmp_path, steps=1)),
            "--policy",
            f"table:{mine}",
            "--out",
            str(out),
            "--json",
            cwd=tmp_path,
            timeout=1800,
        )
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model_shape"] == data["learned_on"]["model_shape"]  # a run records what it ran
