"""`rlsched plan` end to end: its files are consistent with its simulations and run as
written (the simulator config, the `rlsched run` config, vLLM's and verl's settings, the
report page); bad input is one line and exit 2, with nothing written."""

from __future__ import annotations

import json

import pytest
import yaml
from support import ok, rlsched

pytestmark = pytest.mark.e2e  # minutes of end-to-end runs: `make test`, not `make test-fast`

# a small space: plain decoding, static:1, static:3, goodput and twostate over the default preset's
# drafter on 2 GPUs (colocated, or 1 GPU), tp 1, two batch limits, with and without rebalance
SPACE = [
    "--workload",
    "default",
    "--gpus",
    "2",
    "--tp",
    "1",
    "--max-batch",
    "64,256",
    "--seeds",
    "2",
    "--survivors",
    "4",
    "-j",
    "1",
    "--set",
    "rl.steps=1",
    "--model-path",
    "builtin",
    "--drafter-path",
    "builtin",
    "--no-learn",
]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    out = root / "plan"
    proc = ok(rlsched("plan", *SPACE, "--out", str(out), "--json", cwd=root, timeout=1800))
    return root, out, json.loads(proc.stdout), json.loads((out / "plan.json").read_text())


def test_the_plan_ranks_its_simulations_and_compares_the_winner(planned):
    _, out, summary, plan = planned
    assert {p.name for p in out.iterdir()} == {
        "plan.json",
        "summary.json",
        "candidates.csv",
        "pareto.png",
        "sim.yaml",
        "run.yaml",
        "vllm_engine.json",
        "vllm_serve.sh",
        "verl_rollout.yaml",
        "openrlhf_launch.py",
    }
    rows = plan["rows"]
    simulated = [r for r in rows if r["step_s"] is not None]
    assert rows[0]["setup"] == summary["winner"] and rows[0]["seeds"] == 2
    full = [r for r in simulated if r["seeds"] == 2]
    assert rows[0]["step_s"] == min(r["step_s"] for r in full)  # the best of those that ran every seed
    assert summary["candidates"] == len(rows) + summary["dropped"]
    assert summary["speedup_over_baseline"] > 1.0  # a 0.7-acceptance drafter beats plain decoding here
    assert summary["gain_over_own"] == pytest.approx(summary["own_step_s"] / summary["winner_step_s"] - 1)
    split = summary["winner_split"]
    assert sum(split.values()) == pytest.approx(1.0)
    # the one-knob moves from the own setup, simulated on the same seeds, best first
    gains = [k["gain"] for k in plan["knobs"]]
    assert gains == sorted(gains, reverse=True)
    if plan["knobs"]:
        assert summary["knob"].startswith(plan["knobs"][0]["knob"])


def test_the_written_simulator_config_reproduces_the_winner(planned):
    root, out, summary, plan = planned
    proc = ok(
        rlsched(
            "simulate",
            "--config",
            str(out / "sim.yaml"),
            "--no-baseline",
            "--json",
            "--out",
            str(root / "sim"),
            cwd=root,
        )
    )
    winner = plan["rows"][0]
    assert json.loads(proc.stdout)["rl_step_s"] == pytest.approx(winner["step_s_by_seed"]["0"], rel=1e-9)


def test_the_written_vllm_and_verl_settings_are_the_winners(planned):
    _, out, summary, plan = planned
    winner = plan["rows"][0]
    args = json.loads((out / "vllm_engine.json").read_text())
    assert (args["tensor_parallel_size"], args["max_num_seqs"], args["gpu_memory_utilization"]) == (
        winner["tp"],
        winner["max_batch"],
        winner["memory"],
    )
    assert args["model"] == "builtin"
    section = yaml.safe_load((out / "verl_rollout.yaml").read_text())["actor_rollout_ref"]
    verl = section["rollout"]
    assert (
        verl["tensor_model_parallel_size"] == winner["tp"]
        and verl["n"] == 8
        and verl["max_num_seqs"] == (winner["max_batch"])
        and verl["max_model_len"] == args["max_model_len"]
    )
    # a winner that offloads training's states says so in the actor's FSDP settings
    assert ("actor" in section) == winner["offload"]
    if winner["policy"] == "off":
        assert "speculative_config" not in args
        return
    spec = args["speculative_config"]
    assert verl["engine_kwargs"]["vllm"]["speculative_config"] == spec
    assert spec["method"] == "draft_model" and spec["model"] == "builtin"
    # rlsched's scheduler runs the winner's policy (run.yaml's) and picks each step's length up to the longest
    block = args["additional_config"]["rlsched"]
    assert args["scheduler_cls"] == verl["engine_kwargs"]["vllm"]["scheduler_cls"] == "rlsched.vllm.PolicyScheduler"
    assert verl["engine_kwargs"]["vllm"]["additional_config"] == {"rlsched": block}
    policy = yaml.safe_load((out / "run.yaml").read_text())["policy"]
    assert block["policy"] == policy and "num_speculative_tokens_per_batch_size" not in spec
    fixed = policy.startswith(("static:", "twostate:"))  # K; else the longest draft, k_max
    assert spec["num_speculative_tokens"] == (int(policy.split(":")[-1]) if fixed else 8)


def test_the_written_run_config_runs(planned):
    pytest.importorskip("torch")
    root, out, _, plan = planned
    run = yaml.safe_load((out / "run.yaml").read_text())
    assert run["rollout"]["backend"] == "vllm" and run["model"] == "builtin"
    assert run["rollout"]["max_batch"] == plan["rows"][0]["max_batch"]
    assert (run["rollout"]["tp"], run["rollout"]["gpu_memory_utilization"]) == (
        plan["rows"][0]["tp"],
        plan["rows"][0]["memory"],
    )
    assert (run["device"], run["dtype"], run["algorithm"]["name"]) == ("cuda", "bfloat16", "grpo")
    # the built-in pair on this CPU: the local engine, one instance, a few short prompts
    proc = ok(
        rlsched(
            "run",
            "--config",
            str(out / "run.yaml"),
            "--set",
            "rollout.backend=local",
            "--set",
            "rollout.instances=1",
            "--set",
            "rollout.realloc=none",
            "--set",
            "steps=1",
            "--set",
            "rollout.prompts_per_step=2",
            "--set",
            "rollout.group_size=2",
            "--set",
            "rollout.max_tokens=8",
            "--set",
            "rollout.max_batch=8",
            "--set",
            "threads=1",
            "--set",
            "device=cpu",
            "--set",
            "dtype=float32",
            "--out",
            str(root / "run"),
            "--json",
            cwd=root,
            timeout=1800,
        )
    )
    assert json.loads(proc.stdout)["steps"] == 1


def test_the_report_page_draws_the_plan(planned):
    root, out, summary, _ = planned
    page = root / "plan.html"
    proc = ok(rlsched("report", str(out), "--out", str(page), "--json", cwd=root))
    assert json.loads(proc.stdout)["figures"] == ["pareto"]
    text = page.read_text()
    assert 'id="pareto"' in text and summary["winner"] in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "0"], "--gpus must be >= 1 (got 0)"),
        (["--hardware", "tpu-v9"], "hardware"),
        (["--model", "llama-3.1-70b", "--gpus", "1"], "no setup of llama-3.1-70b fits on 1 x h100-sxm"),
        (["--drafters", "eagle"], "--drafters: eagle is not a drafter of default (it has model)"),
        (["--objective", "cheapest"], "--objective must be one of step-time, tokens-per-gpu-s"),
        (["--from", "runs/x", "--workload", "default"], "--from plans from a run's own workload"),
        (["--tp", "0"], "--tp must be comma-separated whole numbers >= 1"),
        (["--tp", "16", "--gpus", "4"], "no --tp in 16 divides the rollout GPUs of --gpus 4"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    proc = rlsched("plan", *args, "--out", str(tmp_path / "plan"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "plan").exists()


TINY_RUN = """
steps: 2
checkpoint_every: 2
threads: 1
rollout: {prompts_per_step: 4, group_size: 4, max_tokens: 16, max_batch: 8, k_max: 3}
algorithm: {minibatches: 1}
drafter_update: {every: 0}
"""


def test_a_plan_from_a_run_uses_its_fitted_costs_and_workload(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "run.yaml").write_text(TINY_RUN)
    ok(
        rlsched(
            "run",
            "--config",
            str(tmp_path / "run.yaml"),
            "--policy",
            "static:2",
            "--out",
            str(tmp_path / "run"),
            cwd=tmp_path,
            timeout=1800,
        )
    )
    out = tmp_path / "plan"
    proc = ok(
        rlsched(
            "plan",
            "--from",
            str(tmp_path / "run"),
            "--gpus",
            "2",
            "--max-batch",
            "4,8",
            "--seeds",
            "1",
            "--survivors",
            "3",
            "-j",
            "1",
            "--no-learn",
            "--out",
            str(out),
            "--json",
            cwd=tmp_path,
            timeout=1800,
        )
    )
    summary = json.loads(proc.stdout)
    assert summary["workload"] == "replay-of-run" and summary["gpus"] == 2
    sim = yaml.safe_load((out / "sim.yaml").read_text())
    assert sim["cost_file"] == str((out / "cost.json").resolve()) and (out / "cost.json").is_file()
    assert sim["workload"]["prompts"] == 4 and sim["workload"]["samples_per_prompt"] == 4
    assert sim["workload"]["response_len"]["dist"] == "empirical"  # the lengths the run produced
    assert {r["tp"] for r in json.loads((out / "plan.json").read_text())["rows"]} == {1}  # one device's costs
    run = yaml.safe_load((out / "run.yaml").read_text())
    assert (run["device"], run["dtype"]) == ("cpu", "float32")  # the run's own machine
    engine = json.loads((out / "vllm_engine.json").read_text())
    assert engine["dtype"] == "float32" and engine["additional_config"]["rlsched"]["cost_model"] == sim["cost_file"]
    ok(
        rlsched(
            "simulate", "--config", str(out / "sim.yaml"), "--no-baseline", "--out", str(tmp_path / "sim"), cwd=tmp_path
        )
    )


def test_the_terminal_output_names_the_winner_and_its_comparisons(tmp_path):
    proc = ok(
        rlsched(
            "plan",
            "--workload",
            "default",
            "--gpus",
            "2",
            "--tp",
            "1",
            "--max-batch",
            "256",
            "--seeds",
            "1",
            "--survivors",
            "2",
            "-j",
            "1",
            "--set",
            "rl.steps=1",
            "--no-learn",
            "--out",
            str(tmp_path / "p"),
            cwd=tmp_path,
        )
    )
    summary = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert f"winner: {summary['winner']}" in proc.stdout
    assert summary["own_gpus"] == summary["baseline_gpus"] == summary["winner_gpus"]
    assert f"over the best plain decoding on {summary['winner_gpus']} GPUs" in proc.stdout
    assert f"over the workload's own setup on {summary['winner_gpus']} GPUs" in proc.stdout


def test_on_a_ray_cluster_the_plan_is_the_same(tmp_path):
    import os

    from test_compare import FAKE_RAY

    (tmp_path / "fake" / "ray").mkdir(parents=True)
    (tmp_path / "fake" / "ray" / "__init__.py").write_text(FAKE_RAY)
    log = tmp_path / "ray.log"
    env = {
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]),
        "FAKE_RAY_LOG": str(log),
    }
    small = [
        "--workload",
        "default",
        "--gpus",
        "2",
        "--tp",
        "1",
        "--max-batch",
        "256",
        "--seeds",
        "1",
        "--survivors",
        "2",
        "--set",
        "rl.steps=1",
        "--no-explain",
        "--no-learn",
    ]
    ok(rlsched("plan", *small, "-j", "1", "--out", str(tmp_path / "local"), cwd=tmp_path))
    ok(rlsched("plan", *small, "--ray", "auto", "--out", str(tmp_path / "ray"), cwd=tmp_path, env_extra=env))
    rows = [json.loads((tmp_path / d / "plan.json").read_text())["rows"] for d in ("local", "ray")]
    assert [(r["setup"], r["step_s"]) for r in rows[0]] == [(r["setup"], r["step_s"]) for r in rows[1]]
    calls = log.read_text().splitlines()
    assert calls.count("task") == sum(r["seeds"] for r in rows[1] if "same_as" not in r)


def test_a_table_learned_for_the_best_chain_setup_is_ranked_and_written(tmp_path):
    from rlsched.config import load_config
    from rlsched.plan.planner import make_plan, write_plan
    from rlsched.plan.space import Space
    from rlsched.policies.policyfile import load_policy_file

    base = load_config(preset="default", overrides=["rl.steps=1", "record_timeline=false"])
    space = Space(2, tps=(1,), max_batches=(256,), static_ks=(2,), reallocs=("none",), colocated=(1.0,))
    plan = make_plan(base, space, seeds=2, survivors=3, explain=False, learn_in=tmp_path)
    learned = [x for x in plan.ranked if x.candidate.policy.family == "table"]
    assert len(learned) == 1 and len(learned[0].runs) == 2 and learned[0].evaluations > 0
    assert learned[0].candidate.label.endswith("table:model (learned)")
    pf = load_policy_file(tmp_path / "policy.json")
    assert pf.kind == "table" and pf.created["seeds"] == [2]  # learned on the seed after the plan's 0 and 1
    # written as the winner: sim.yaml, run.yaml and vLLM's engine (rlsched's scheduler) name the plan's copy
    plan.ranked.remove(learned[0])
    plan.ranked.insert(0, learned[0])
    out = tmp_path / "plan"
    write_plan(plan, out, "builtin", "builtin")
    copy = f"table:{(out / 'policy.json').resolve()}"
    sim = yaml.safe_load((out / "sim.yaml").read_text())
    assert sim["speculation"]["policy"] == copy
    assert yaml.safe_load((out / "run.yaml").read_text())["policy"] == copy
    engine = json.loads((out / "vllm_engine.json").read_text())
    assert engine["scheduler_cls"] == "rlsched.vllm.PolicyScheduler"
    assert engine["additional_config"]["rlsched"]["policy"] == copy
    spec = engine["speculative_config"]  # the table picks each step's length up to k_max, in the scheduler
    assert spec["num_speculative_tokens"] == base.speculation.k_max
    assert "num_speculative_tokens_per_batch_size" not in spec and not (out / "vllm_table.json").exists()
    proc = ok(
        rlsched(
            "simulate",
            "--config",
            str(out / "sim.yaml"),
            "--no-baseline",
            "--json",
            "--out",
            str(tmp_path / "sim"),
            cwd=tmp_path,
        )
    )
    assert json.loads(proc.stdout)["rl_step_s"] == pytest.approx(learned[0].runs[0]["step_s"], rel=1e-9)
