"""What `rlsched plan` writes runs as planned, and its report compares like with like: run.yaml
carries every knob of the winner (the job's algorithm, tp, memory fraction, device, dtype); the
winner is compared with the workload's own setup and plain decoding on its own GPU count, or
the plan says why not; setups the seeds cannot tell apart are called ties; an EAGLE-3 head is
written as a marked placeholder, never the built-in head's name; vLLM's, verl's and OpenRLHF's
files run the winner's policy itself in rlsched's scheduler; bad output places are one line."""

from __future__ import annotations

import ast
import json
import shlex
from dataclasses import replace

import pytest
import yaml
from support import ok, one_line_error, rlsched, snapshot
from test_engine_args import _missing, _vendored_verl

from rlsched.config import load_config
from rlsched.executor.rl.config import build_run_config, load_run_config
from rlsched.plan.compare import is_tie, own_at
from rlsched.plan.feasible import longest_sequence
from rlsched.plan.screen import Scored
from rlsched.plan.search import Ranked
from rlsched.plan.space import Candidate
from rlsched.policies.engine_args import openrlhf_flags, verl_rollout_section, vllm_serve_argv
from rlsched.policies.registry import parse_policy

PPO = "rlhfspec-llama3.1-8b-ppo"  # PPO (a critic), its own setup 8 x tp 2 on 16 H100s, memory 0.6
SMALL = ["--max-batch", "1024", "--seeds", "2", "--survivors", "4", "-j", "1", "--no-learn"]


@pytest.fixture(scope="module")
def ppo_plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo")
    out = root / "plan"
    proc = ok(rlsched("plan", "--workload", PPO, "--gpus", "8", *SMALL, "--out", str(out), cwd=root, timeout=1800))
    return out, proc.stdout, json.loads((out / "plan.json").read_text())


def test_the_ppo_run_config_carries_the_winners_knobs(ppo_plan):
    out, _, plan = ppo_plan
    winner = plan["rows"][0]
    run = yaml.safe_load((out / "run.yaml").read_text())
    assert run["algorithm"]["name"] == "ppo"  # the job has a critic: PPO, not GRPO over groups of 1
    assert run["rollout"]["group_size"] == 1
    assert (run["rollout"]["tp"], run["rollout"]["gpu_memory_utilization"]) == (winner["tp"], winner["memory"])
    assert (run["rollout"]["instances"], run["rollout"]["max_batch"]) == (winner["instances"], winner["max_batch"])
    assert (run["device"], run["dtype"]) == ("cuda", "bfloat16")  # an H100 preset, a 2-byte model
    cfg = load_run_config(out / "run.yaml")  # the run config takes it as written
    assert (cfg.algorithm.name, cfg.rollout.tp, cfg.rollout.gpu_memory_utilization) == (
        "ppo",
        winner["tp"],
        winner["memory"],
    )
    assert (cfg.device, cfg.dtype, cfg.rollout.backend) == ("cuda", "bfloat16", "vllm")
    engine = json.loads((out / "vllm_engine.json").read_text())
    assert engine["dtype"] == "bfloat16" and engine["tensor_parallel_size"] == winner["tp"]
    verl = yaml.safe_load((out / "verl_rollout.yaml").read_text())
    assert verl["algorithm"]["adv_estimator"] == "gae"
    assert engine["additional_config"]["rlsched"]["policy"] == run["policy"]
    _engine_files_agree(out, engine)


ENGINE_FILES = ("vllm_engine.json", "vllm_serve.sh", "verl_rollout.yaml", "openrlhf_launch.py")


def _engine_files_agree(out, engine: dict) -> None:
    """The serve script, verl's section and OpenRLHF's launcher hold the engine arguments of
    vllm_engine.json, and verl's keys are all in verl's config."""
    serve = shlex.split((out / "vllm_serve.sh").read_text().replace("\\\n", ""), comments=True)
    assert serve[1:-1] == vllm_serve_argv(engine)  # exec ... "$@"
    verl = yaml.safe_load((out / "verl_rollout.yaml").read_text())
    assert not _missing(verl, _vendored_verl())
    rollout = verl["actor_rollout_ref"]["rollout"]
    assert {k: rollout[k] for k in verl_rollout_section(engine)["actor_rollout_ref"]["rollout"]} == (
        verl_rollout_section(engine)["actor_rollout_ref"]["rollout"]
    )
    tree = ast.parse((out / "openrlhf_launch.py").read_text())
    values = {
        n.targets[0].id: ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and n.targets[0].id.isupper()
    }
    assert (values["FLAGS"], values["ENGINE_KWARGS"]) == openrlhf_flags(engine)


def test_the_engine_files_run_the_winners_policy_in_rlscheds_scheduler(tmp_path):
    from rlsched.plan.planner import make_plan, write_plan
    from rlsched.plan.space import Space

    base = load_config(preset="default", overrides=["rl.steps=1", "record_timeline=false"])
    space = Space(2, tps=(1,), max_batches=(256,), static_ks=(2,), reallocs=("none",), colocated=(1.0,), split=())
    plan = make_plan(base, space, seeds=1, survivors=4, explain=False)
    for family in ("goodput", "twostate"):
        adaptive = next(x for x in plan.ranked if x.candidate.policy.family == family)
        plan.ranked.remove(adaptive)
        plan.ranked.insert(0, adaptive)  # written as the winner
        out = tmp_path / family
        write_plan(plan, out, "/models/qwen2.5-7b", "/models/qwen2.5-0.5b")
        assert {p.name for p in out.iterdir()} >= set(ENGINE_FILES)
        engine = json.loads((out / "vllm_engine.json").read_text())
        block = engine["additional_config"]["rlsched"]
        run = yaml.safe_load((out / "run.yaml").read_text())
        assert engine["scheduler_cls"] == "rlsched.vllm.PolicyScheduler"
        assert block["policy"] == run["policy"]  # the policy itself, as run.yaml runs it
        assert block["cost_model"] == base.hardware.name and block["trace_dir"] == str(tmp_path / f"{family}-traces")
        spec = engine["speculative_config"]
        if family == "goodput":  # it picks each step's draft length up to k_max
            assert block["policy"] == adaptive.candidate.policy.text == "goodput"
            assert spec["num_speculative_tokens"] == base.speculation.k_max
        else:  # solved here, as the simulator ran it: its threshold and k
            assert block["policy"].startswith("twostate:")
            assert spec["num_speculative_tokens"] == int(block["policy"].split(":")[2])
        assert spec["model"] == "/models/qwen2.5-0.5b" and "num_speculative_tokens_per_batch_size" not in spec
        assert (engine["model"], engine["max_num_seqs"], engine["max_model_len"]) == (
            "/models/qwen2.5-7b",
            256,
            longest_sequence(base),
        )
        _engine_files_agree(out, engine)
        scheduler = pytest.importorskip("rlsched.executor.vllm.scheduler")
        assert scheduler.EngineHookConfig.model_validate(block).policy == block["policy"]


def test_a_priced_policy_on_hardware_no_preset_names_gets_a_marked_cost_placeholder():
    from rlsched.plan.output import COST_PLACEHOLDER, engine_cost_model

    cfg = load_config(preset="default", overrides=["hardware.name=my-gpu"])
    assert engine_cost_model(cfg, parse_policy("goodput")) == COST_PLACEHOLDER.format(hardware="my-gpu")
    assert engine_cost_model(cfg, parse_policy("static:2")) is None
    assert engine_cost_model(cfg.model_copy(update={"cost_file": "/c/fit.json"}), parse_policy("goodput")) == (
        "/c/fit.json"
    )
    assert engine_cost_model(load_config(preset="default"), parse_policy("goodput")) == "h100-sxm"


def test_the_own_setup_is_compared_on_the_winners_gpus(ppo_plan):
    out, stdout, plan = ppo_plan
    s = plan["summary"]
    assert s["gpus"] == 8 and s["own_written_gpus"] == 16  # the preset's own setup holds 16 GPUs
    assert s["own_gpus"] == s["winner_gpus"] == s["baseline_gpus"]  # like with like
    own = next(r for r in plan["rows"] if r["setup"] == s["own_setup"])
    assert own["gpus"] == s["winner_gpus"] and own["tp"] == 2 and own["seeds"] == 2  # the preset's tp, scaled
    assert "holds 16 GPUs" in s["own_note"] and f"on the winner's {s['winner_gpus']} GPUs" in s["own_note"]
    assert f"over the workload's own setup on {s['winner_gpus']} GPUs" in stdout
    assert f"note: {s['own_note']}" in stdout
    for k in plan["knobs"]:  # a knob's values name their GPUs: a GPU count never changes unseen
        if k["knob"] == "placement":
            assert "GPUs" in k["from"] and "GPUs" in k["to"]


def _gaps(row, winner):
    return [row["step_s_by_seed"][s] / winner["step_s_by_seed"][s] - 1 for s in winner["step_s_by_seed"]]


def test_setups_the_seeds_cannot_tell_from_the_winner_are_called_ties(ppo_plan):
    _, stdout, plan = ppo_plan
    s, rows = plan["summary"], plan["rows"]
    winner = rows[0]
    full = [r for r in rows[1:] if r["seeds"] == 2 and "same_as" not in r]
    expected = set()
    for r in full:
        g = _gaps(r, winner)
        if min(g) <= 0 or r["step_s"] / winner["step_s"] - 1 <= max(g) - min(g):
            expected.add(r["setup"])
    assert {t["setup"] for t in s["ties"]} == expected and s["tie_count"] == len(expected)
    assert s["baseline_tie"] == (s["baseline"] in expected)
    if expected:
        assert "a tie: over 2 seeds the winner is not told apart from" in stdout
    if s["baseline_tie"]:
        assert "(a tie within the seeds' spread)" in stdout


def _ranked(step_by_seed: dict[int, float]) -> Ranked:
    c = Candidate(1, 1, 64, 0.9, parse_policy("off"), None)
    runs = [{"seed": k, "step_s": v, "tokens": 100.0} for k, v in step_by_seed.items()]
    return Ranked(Scored(c, None, 1.0, 1.0, 100, 1.0), runs)  # type: ignore[arg-type]


def test_a_tie_is_a_gap_the_seeds_do_not_settle():
    winner = _ranked({0: 10.0, 1: 10.0, 2: 10.0})
    assert is_tie(_ranked({0: 9.9, 1: 10.2, 2: 10.2}), winner, "step-time")  # faster on one seed
    assert is_tie(_ranked({0: 10.01, 1: 10.2, 2: 10.05}), winner, "step-time")  # gap 0.9% within a 1.9% spread
    assert not is_tie(_ranked({0: 10.5, 1: 10.6, 2: 10.55}), winner, "step-time")  # 5.5% against a 1% spread
    assert not is_tie(_ranked({0: 10.1}), _ranked({0: 10.0}), "step-time")  # one seed: no spread


def test_the_own_setup_scales_to_a_gpu_count_or_says_why_not():
    base = load_config(preset=PPO, overrides=["record_timeline=false"])  # tp 2 x 8, colocated
    c, why = own_at(base, 8)
    assert why is None and (c.tp, c.instances, c.gpus, c.memory) == (2, 4, 8, 0.6)
    c, why = own_at(base, 3)
    assert c is None and "tp 2 does not divide the 3 rollout GPUs" in why
    split = load_config(preset=PPO, overrides=["rl.train_gpus=4", "cluster.instances=6"])  # 12 + 4
    c, why = own_at(split, 32)
    assert why is None and (c.tp, c.rollout_gpus, c.train_gpus) == (2, 24, 8)
    c, why = own_at(split, 6)
    assert c is None and "does not scale to 6 GPUs" in why


def test_a_comparison_that_cannot_be_made_is_said(tmp_path):
    # the own setup is one tp-2 instance; on 3 GPUs no tp-2 setup can be made
    proc = ok(
        rlsched(
            "plan",
            "--workload",
            "default",
            "--gpus",
            "3",
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
            "--no-learn",
            "--set",
            "rl.steps=1",
            "--set",
            "cluster.tp=2",
            "--set",
            "cluster.instances=1",
            "--out",
            str(tmp_path / "p"),
            cwd=tmp_path,
            timeout=1800,
        )
    )
    s = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert "own_setup" not in s and "gain_over_own" not in s
    assert s["own_note"].startswith("no comparison with the workload's own setup on the winner's 3 GPUs")
    assert "tp 2 does not divide" in s["own_note"] and f"note: {s['own_note']}" in proc.stdout


def test_an_eagle_head_is_written_as_a_marked_placeholder(tmp_path):
    from rlsched.plan.planner import make_plan, write_plan
    from rlsched.plan.space import Space

    base = load_config(preset="eagle-h200-14b", overrides=["rl.steps=1", "record_timeline=false"])
    space = Space(2, tps=(2,), max_batches=(256,), static_ks=(2,), reallocs=("none",), colocated=(1.0,), split=())
    plan = make_plan(base, space, seeds=1, survivors=3, explain=False)
    eagle = next(x for x in plan.ranked if x.candidate.drafter == "eagle")
    plan.ranked.remove(eagle)
    plan.ranked.insert(0, eagle)  # written as the winner
    out = tmp_path / "plan"
    summary = write_plan(plan, out, "/models/qwen2.5-14b")
    run = yaml.safe_load((out / "run.yaml").read_text())
    assert run["drafter"] != "eagle" and run["drafter"].startswith("REPLACE-ME/")  # never the built-in head's name
    assert "placeholder" in (out / "run.yaml").read_text().splitlines()[1]
    spec = json.loads((out / "vllm_engine.json").read_text())["speculative_config"]
    assert spec["model"] == run["drafter"] and spec["method"] == "eagle3"
    assert run["drafter"] in summary["drafter_note"]
    assert build_run_config(run).drafter == run["drafter"]
    # a head's folder given is written as given
    write_plan(plan, out, "/models/qwen2.5-14b", "/models/qwen14b-eagle3")
    assert yaml.safe_load((out / "run.yaml").read_text())["drafter"] == "/models/qwen14b-eagle3"


def test_the_local_engine_refuses_tensor_parallelism(tmp_path):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"rollout": {"tp": 2}}))
    proc = rlsched("run", "--config", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run"), cwd=tmp_path)
    one_line_error(proc, "rollout.tp", "rollout.backend vllm")
    assert not (tmp_path / "run").exists()
    assert build_run_config({"rollout": {"backend": "vllm", "tp": 2}}).rollout.tp == 2
    with pytest.raises(Exception, match="gpu_memory_utilization"):
        build_run_config({"rollout": {"backend": "vllm", "gpu_memory_utilization": 1.5}})


QUICK = ["--workload", "default", "--gpus", "2", "--tp", "1", "--max-batch", "256", "--seeds", "1"]


@pytest.mark.parametrize(
    "setup, args, names",
    [
        ("file", [], ["--out", "is a file"]),
        ("folder", [], ["--out", "not an earlier plan", "new or empty folder"]),
        (None, ["--tp", "16", "--gpus", "4"], ["--tp", "--gpus 4"]),
        (None, ["--drafter-path", "eagle", "--model-path", "/m/qwen"], ["--drafter-path eagle", "EAGLE-3 head"]),
    ],
)
def test_bad_output_places_and_paths_are_one_line(tmp_path, setup, args, names):
    out = tmp_path / "out"
    if setup == "file":
        out.write_text("mine\n")
    elif setup == "folder":
        out.mkdir()
        (out / "notes.txt").write_text("mine\n")
    before = snapshot(tmp_path)
    proc = rlsched("plan", *QUICK, *args, "--no-learn", "-j", "1", "--out", str(out), cwd=tmp_path)
    one_line_error(proc, *names)
    assert snapshot(tmp_path) == before
    if setup == "file":
        assert out.read_text() == "mine\n"


def test_a_plan_replaces_an_earlier_plan(tmp_path):
    out = tmp_path / "plan"
    args = [*QUICK, "--survivors", "2", "-j", "1", "--no-learn", "--no-explain", "--set", "rl.steps=1"]
    ok(rlsched("plan", *args, "--out", str(out), cwd=tmp_path))
    first = json.loads((out / "summary.json").read_text())
    ok(rlsched("plan", *args, "--out", str(out), cwd=tmp_path))
    assert json.loads((out / "summary.json").read_text())["winner"] == first["winner"]


def test_a_placement_knob_names_its_gpus():
    from rlsched.plan.planner import knob_value

    c = Candidate(2, 4, 256, 0.6, parse_policy("off"), None)
    assert knob_value(c, "placement") == "colocated on 8 GPUs"
    assert knob_value(replace(c, train_gpus=2), "placement") == "split 8+2 on 10 GPUs"


def test_verls_node_layout_holds_exactly_the_plans_gpus():
    from rlsched.plan.output import verl_nodes

    for gpus in range(1, 65):
        n = verl_nodes(gpus)
        assert n["n_gpus_per_node"] * n["nnodes"] == gpus and n["n_gpus_per_node"] <= 8
    assert verl_nodes(12) == {"n_gpus_per_node": 6, "nnodes": 2}
