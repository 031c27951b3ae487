"""What a user adds to vLLM, verl and OpenRLHF to run a policy in rlsched's scheduler
(`policies/engine_args.py`): the engine kwargs, the `vllm serve` line read back by a shell, verl's
rollout keys held against verl's own config schema (vendored from verl 0.9.1, and the installed
verl's where there is one), OpenRLHF's flags and its launcher run against a stand-in OpenRLHF,
refusals in one line, and the files `rlsched learn` writes beside its policy file."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from support import ok, one_line_error, rlsched, snapshot

from rlsched.errors import UserError
from rlsched.policies.engine_args import (
    OPENRLHF_OWN,
    SCHEDULER_CLS,
    EngineFacts,
    HookSettings,
    framework_files,
    openrlhf_flags,
    verl_rollout_section,
    vllm_engine_kwargs,
    vllm_serve_argv,
    vllm_serve_script,
)

DATA = Path(__file__).parent / "data"
DRAFT = EngineFacts("/models/qwen2.5-7b", "model", "/models/qwen2.5-0.5b", k_max=6, max_num_seqs=64)
EAGLE = EngineFacts(
    "Qwen/Qwen2.5-7B",
    "eagle",
    "/heads/eagle 3",
    k_max=4,
    max_num_seqs=128,
    tensor_parallel_size=2,
    gpu_memory_utilization=0.45,
    max_model_len=9216,
    dtype="bfloat16",
)
NGRAM = EngineFacts("m", "ngram", k_max=5, max_num_seqs=32)
CASES = [
    (DRAFT, HookSettings("goodput", cost_model="h100-sxm", trace_dir="/runs/traces", seed=3)),
    (EAGLE, HookSettings("seqgoodput", cost_model="/costs/fit it.json", probe_every=16)),
    (NGRAM, HookSettings("static:3")),
    (DRAFT, HookSettings("twostate:8:3")),
    (DRAFT, HookSettings("off", trace_dir="/runs/base")),
]


def _dotted(d: dict, prefix: str = "") -> list[str]:
    keys = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        keys.append(key)
        if isinstance(v, dict):
            keys += _dotted(v, key + ".")
    return keys


def _missing(written: dict, schema: set[str]) -> list[str]:
    """Keys of `written` (dotted) that verl's schema has not: neither the key nor a free mapping
    (`KEY.*`) above it."""
    free = [k[:-2] for k in schema if k.endswith(".*")]
    return [k for k in _dotted(written) if k not in schema and not any(k.startswith(f + ".") for f in free if f != k)]


def _vendored_verl() -> set[str]:
    lines = (DATA / "verl_rollout_keys.txt").read_text().splitlines()
    assert lines[0].startswith("# verl 0.9.1") and "_generated_ppo_trainer.yaml" in lines[1]
    return {line for line in lines if line and not line.startswith("#")}


def _plan_verl() -> dict:
    """What `rlsched plan` writes as verl's settings, for a colocated winner that offloads."""
    from rlsched.config import load_config
    from rlsched.plan.output import verl_rollout, vllm_engine_args
    from rlsched.plan.space import Candidate
    from rlsched.policies.registry import parse_policy

    cfg = load_config("default")
    c = Candidate(2, 1, 64, 0.5, parse_policy("goodput"), "model", offload=True)
    return verl_rollout(cfg, c, vllm_engine_args(cfg, c, None, "/m/qwen", "/m/small", trace_dir="/runs/traces"))


# ----------------------------------------------------------------------------- the writers


@pytest.mark.parametrize("facts, hook", CASES)
def test_engine_kwargs_carry_the_scheduler_its_block_and_vllms_own_settings(facts, hook):
    kw = vllm_engine_kwargs(facts, hook)
    assert kw["scheduler_cls"] == SCHEDULER_CLS == "rlsched.vllm.PolicyScheduler"
    block = kw["additional_config"]["rlsched"]
    assert block["policy"] == hook.policy and block["seed"] == hook.seed
    assert block.get("cost_model") == hook.cost_model and block.get("trace_dir") == hook.trace_dir
    assert (kw["model"], kw["max_num_seqs"], kw["tensor_parallel_size"]) == (
        facts.model,
        facts.max_num_seqs,
        facts.tensor_parallel_size,
    )
    spec = kw.get("speculative_config")
    if hook.policy == "off":
        assert spec is None
        return
    k = {"static:3": 3, "twostate:8:3": 3}.get(hook.policy, facts.k_max)  # the hook's policies draft up to k_max
    assert spec["num_speculative_tokens"] == k
    assert spec["method"] == {"model": "draft_model", "eagle": "eagle3", "ngram": "ngram"}[facts.drafter]
    assert spec.get("model") == facts.drafter_path


def test_the_hook_block_is_what_the_scheduler_reads():
    scheduler = pytest.importorskip("rlsched.executor.vllm.scheduler")
    for facts, hook in CASES:
        block = vllm_engine_kwargs(facts, hook)["additional_config"]["rlsched"]
        assert scheduler.EngineHookConfig.model_validate(block).policy == hook.policy


@pytest.mark.parametrize("facts, hook", CASES)
def test_the_serve_line_reads_back_as_the_engine_kwargs(tmp_path, facts, hook):
    """The script run by /bin/sh hands a stand-in `vllm` the words vLLM parses: each flag's
    value (JSON where a mapping) gives back the kwargs."""
    kw = vllm_engine_kwargs(facts, hook)
    script = tmp_path / "serve.sh"
    script.write_text(vllm_serve_script(kw, "a title"))
    fake = tmp_path / "bin" / "vllm"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}")
    proc = subprocess.run(["sh", str(script), "--port", "8001"], capture_output=True, text=True, env=env, timeout=60)
    argv = json.loads(proc.stdout)
    assert argv == vllm_serve_argv(kw)[1:] + ["--port", "8001"]  # the user's own flags follow
    words = shlex.split(script.read_text().replace("\\\n", ""), comments=True)  # continued lines joined
    assert words[1:-1] == vllm_serve_argv(kw)
    assert argv[:2] == ["serve", facts.model]
    back = {"model": argv[1]}
    for flag, value in zip(argv[2:-2:2], argv[3:-2:2]):
        key = flag[2:].replace("-", "_")
        back[key] = json.loads(value) if value.startswith("{") else type(kw[key])(value)
    assert back == kw


@pytest.mark.vllm
def test_vllms_own_parser_reads_the_serve_line():
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    for facts, hook in CASES:
        kw = vllm_engine_kwargs(facts, hook)
        argv = vllm_serve_argv(kw)
        parsed = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", argv[2], *argv[3:]]))
        direct = AsyncEngineArgs(**kw)
        for key, value in kw.items():
            assert getattr(parsed, key) == getattr(direct, key) == value, key


def test_a_title_with_line_breaks_stays_one_comment_line():
    from rlsched.policies.engine_args import engine_files

    kw = vllm_engine_kwargs(DRAFT, HookSettings("static:2"))
    files = engine_files(kw, "p.", title="a model\nexit 3\r\nimport os")
    serve = files["p.vllm_serve.sh"]
    assert serve.splitlines()[1].startswith("# a model exit 3 import os (")
    assert shlex.split(serve.replace("\\\n", ""), comments=True)[1:-1] == vllm_serve_argv(kw)
    launcher = files["p.openrlhf_launch.py"].splitlines()
    assert launcher[1] == "# a model exit 3 import os" and "import os" not in launcher[2:]
    assert files["p.verl_rollout.yaml"].splitlines()[0].startswith("# a model exit 3 import os:")


# ----------------------------------------------------------------------------- verl's schema


@pytest.mark.parametrize("facts, hook", CASES)
def test_every_verl_key_written_is_in_verls_rollout_schema(facts, hook):
    schema = _vendored_verl()
    section = verl_rollout_section(vllm_engine_kwargs(facts, hook))
    assert not _missing(section, schema)
    rollout = section["actor_rollout_ref"]["rollout"]
    assert "actor_rollout_ref.rollout.engine_kwargs.vllm.*" in schema  # vLLM's own arguments go there
    assert rollout["engine_kwargs"]["vllm"]["scheduler_cls"] == SCHEDULER_CLS
    # a drafter with weights is read from its folder: verl's default load_format (dummy) would not
    assert (rollout.get("load_format") == "auto") == (facts.drafter in ("model", "eagle") and hook.policy != "off")
    assert not _missing(_plan_verl(), schema)  # and `rlsched plan`'s verl settings


def test_the_key_check_finds_a_key_verl_has_not():
    schema = _vendored_verl()
    section = {"actor_rollout_ref": {"rollout": {"max_num_seqs": 8, "speculative_config": {}, "engine_kwargs": {}}}}
    assert _missing(section, schema) == ["actor_rollout_ref.rollout.speculative_config"]


def test_every_verl_key_written_is_in_the_installed_verl():
    """Against the verl package installed here (its files read, not imported): the flattened
    trainer config and RolloutConfig's fields."""
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.submodule_search_locations is None:
        pytest.skip("verl is not installed here; the vendored key list stands for it")
    root = Path(next(iter(spec.submodule_search_locations)))
    flat = yaml.safe_load((root / "trainer" / "config" / "_generated_ppo_trainer.yaml").read_text())
    schema = set()

    def walk(d, prefix=""):
        for k, v in d.items():
            schema.add(prefix + k)
            if isinstance(v, dict):
                walk(v, prefix + k + ".") if v else schema.add(prefix + k + ".*")

    walk(flat)
    tree = ast.parse((root / "workers" / "config" / "rollout.py").read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "RolloutConfig")
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for facts, hook in CASES:
        section = verl_rollout_section(vllm_engine_kwargs(facts, hook))
        assert not _missing(section, schema)
        assert set(section["actor_rollout_ref"]["rollout"]) <= fields
    assert not _missing(_plan_verl(), schema)


# ----------------------------------------------------------------------------- OpenRLHF


def test_openrlhf_flags_are_its_own_and_the_rest_are_engine_kwargs():
    known = {line for line in (DATA / "openrlhf_train_ppo_ray_flags.txt").read_text().splitlines() if line[:1] == "-"}
    kw = vllm_engine_kwargs(EAGLE, CASES[1][1])
    flags, extra = openrlhf_flags(kw)
    assert {f for f in flags if f.startswith("--")} <= known and "--vllm.tensor_parallel_size" in flags
    assert flags[flags.index("--data.max_len") + 1] == "9216" and "--vllm.enable_prefix_caching" in flags
    assert not set(extra) & set(OPENRLHF_OWN)
    assert {"scheduler_cls", "additional_config", "speculative_config", "max_num_seqs"} <= set(extra)


FAKE_OPENRLHF = {
    "openrlhf/__init__.py": "",
    "openrlhf/trainer/__init__.py": "",
    "openrlhf/trainer/ray/__init__.py": "from .vllm_engine import create_vllm_engines\n",
    "openrlhf/trainer/ray/vllm_engine.py": """
        import json, os

        class _Handle:
            def __init__(self, options):
                self.options = options

            def remote(self, **kwargs):
                with open(os.environ["STARTED"], "a") as f:
                    f.write(json.dumps(kwargs) + "\\n")

        class RolloutRayActor:  # as OpenRLHF 0.11's: a Ray actor class started with .options(...).remote(**kw)
            @classmethod
            def options(cls, **options):
                return _Handle(options)

        def create_vllm_engines(num_engines, tensor_parallel_size, pretrain, gpu_memory_utilization, max_len):
            for i in range(num_engines):
                RolloutRayActor.options(num_gpus=1).remote(
                    model=pretrain, tensor_parallel_size=tensor_parallel_size, seed=i,
                    gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_len)
        """,
    "openrlhf/cli/__init__.py": "",
    "openrlhf/cli/train_ppo_ray.py": """
        import argparse
        from openrlhf.trainer.ray import create_vllm_engines

        if __name__ == "__main__":
            p = argparse.ArgumentParser()
            for flag in ("--actor.model_name_or_path", "--vllm.tensor_parallel_size", "--vllm.num_engines",
                         "--vllm.gpu_memory_utilization", "--data.max_len"):
                p.add_argument(flag)
            p.add_argument("--vllm.enable_prefix_caching", action="store_true")
            a = vars(p.parse_args())
            assert a["vllm.enable_prefix_caching"]
            create_vllm_engines(int(a["vllm.num_engines"]), int(a["vllm.tensor_parallel_size"]),
                                a["actor.model_name_or_path"], float(a["vllm.gpu_memory_utilization"]),
                                int(a["data.max_len"]))
        """,
}


def test_the_openrlhf_launcher_starts_every_engine_with_the_engine_kwargs(tmp_path):
    for name, text in FAKE_OPENRLHF.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    kw = vllm_engine_kwargs(EAGLE, CASES[1][1])
    files = framework_files(EAGLE, CASES[1][1], "p")
    (tmp_path / "p.openrlhf_launch.py").write_text(files["p.openrlhf_launch.py"])
    started = tmp_path / "started.jsonl"
    env = dict(os.environ, PYTHONPATH=str(tmp_path), STARTED=str(started))
    proc = subprocess.run(
        [sys.executable, "p.openrlhf_launch.py", "--vllm.num_engines", "2", "--vllm.gpu_memory_utilization", "0.3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    engines = [json.loads(line) for line in started.read_text().splitlines()]
    assert len(engines) == 2 and [e["seed"] for e in engines] == [0, 1]
    for e in engines:
        assert {k: e[k] for k in kw if k not in OPENRLHF_OWN} == {k: v for k, v in kw.items() if k not in OPENRLHF_OWN}
        assert (e["model"], e["tensor_parallel_size"], e["max_model_len"]) == ("Qwen/Qwen2.5-7B", 2, 9216)
        assert e["gpu_memory_utilization"] == 0.3  # the user's flag after the launcher's


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "facts, hook, names",
    [
        (DRAFT, HookSettings("fastest"), ["policy 'fastest'", "goodput"]),
        (DRAFT, HookSettings("goodput"), ["policy 'goodput'", "cost_model", "h100-sxm"]),
        (DRAFT, HookSettings("goodput", cost_model="h100"), ["cost_model 'h100'", ".json"]),
        (DRAFT, HookSettings("tree:3:2:4"), ["tree:3:2:4", "chains"]),
        (DRAFT, HookSettings("static:9"), ["static:9", "k_max"]),
        (DRAFT, HookSettings("oracle"), ["oracle", "simulate"]),
        (DRAFT, HookSettings("table:/no/such.json"), ["/no/such.json", "does not exist"]),
        (EngineFacts("m", "eagle", None), HookSettings("static:2"), ["drafter eagle", "drafter_path"]),
        (EngineFacts("m", "model", "d", max_num_seqs=0), HookSettings("off"), ["max_num_seqs", ">= 1"]),
        (EngineFacts("m", "off"), HookSettings("static:2"), ["static:2", "drafter"]),
        (DRAFT, HookSettings("static:2", probe_every=0), ["probe_every"]),
    ],
)
def test_what_cannot_run_is_one_line_naming_it(facts, hook, names):
    with pytest.raises(UserError) as e:
        vllm_engine_kwargs(facts, hook)
    line = str(e.value)
    assert "\n" not in line
    for name in names:
        assert name in line


# ----------------------------------------------------------------------------- rlsched learn

SMALL = ["--set", "workload.prompts=8", "--set", "rl.steps=1", "-j", "1", "--kind", "twostate", "--json"]
SUFFIXES = (".vllm_engine.json", ".vllm_serve.sh", ".verl_rollout.yaml", ".openrlhf_launch.py")


def test_learn_writes_the_framework_files_beside_its_policy_file(tmp_path):
    out = tmp_path / "pol" / "p.json"
    args = ["--model-path", "/m/qwen", "--drafter-path", "/m/small", "--trace-dir", "tr"]
    summary = json.loads(ok(rlsched("learn", *SMALL, "--out", str(out), *args, cwd=tmp_path)).stdout)
    written = {out.with_name("p" + s) for s in SUFFIXES}
    assert snapshot(tmp_path) == {"pol", "pol/p.json", *(f"pol/{p.name}" for p in written)}
    assert {"policy_file", "kind", "params", "realloc", "generation_s", "evaluations", "seeds"} <= set(summary)
    assert summary["policy_file"] == str(out) and {Path(p) for p in summary["frameworks"]} == written
    kw = json.loads(out.with_name("p.vllm_engine.json").read_text())
    block = kw["additional_config"]["rlsched"]
    assert block == {"policy": f"twostate:{out}", "trace_dir": str(tmp_path / "tr"), "seed": 0}
    assert kw["model"] == "/m/qwen" and kw["speculative_config"]["model"] == "/m/small"
    assert kw["speculative_config"]["num_speculative_tokens"] == summary["params"]["k"]
    verl = yaml.safe_load(out.with_name("p.verl_rollout.yaml").read_text())
    assert verl["actor_rollout_ref"]["rollout"]["engine_kwargs"]["vllm"]["additional_config"]["rlsched"] == block
    assert not _missing(verl, _vendored_verl())
    serve = shlex.split(out.with_name("p.vllm_serve.sh").read_text().replace("\\\n", ""), comments=True)
    assert serve[1:4] == ["vllm", "serve", "/m/qwen"] and json.loads(serve[serve.index("--additional-config") + 1]) == {
        "rlsched": block
    }
    assert ast.parse(out.with_name("p.openrlhf_launch.py").read_text())  # Python, holding the same block
    # the policy the files name runs: a simulation of it by that name
    sim = ["simulate", "--set", "workload.prompts=8", "--set", "rl.steps=1", "--no-baseline", "--json"]
    ok(rlsched(*sim, "--policy", block["policy"], "--out", str(tmp_path / "sim"), cwd=tmp_path))


def test_learn_writes_no_framework_files_for_a_tree_policy(tmp_path):
    tree = ["--set", "speculation.width_max=2", "--out", "p.json"]
    summary = json.loads(ok(rlsched("learn", *SMALL, *tree, cwd=tmp_path)).stdout)
    assert snapshot(tmp_path) == {"p.json"} and "frameworks" not in summary
    assert "width_max=1" in summary["frameworks_note"]


def test_learn_refuses_a_vllm_table_where_the_engine_file_goes(tmp_path):
    proc = rlsched("learn", *SMALL, "--out", "p.json", "--vllm-table", "p.vllm_engine.json", cwd=tmp_path)
    one_line_error(proc, "--vllm-table", "p.vllm_engine.json")
    assert snapshot(tmp_path) == set()


def test_a_learned_policys_engine_comes_from_its_config(tmp_path):
    from rlsched.config import load_config
    from rlsched.sim.learn import default_trace_dir, engine_facts

    cfg = load_config("default", overrides=["cluster.tp=2", "cluster.max_batch=96"])
    facts = engine_facts(cfg)
    assert (facts.model, facts.drafter, facts.drafter_path) == ("qwen2.5-7b", "model", "qwen2.5-0.5b")
    assert (facts.k_max, facts.max_num_seqs, facts.tensor_parallel_size) == (8, 96, 2)
    assert facts.max_model_len == 1024 + 8192  # the workload's longest prompt and response: vLLM's window
    eagle = engine_facts(load_config("default", overrides=["drafters.0.kind=eagle"]), "/m/q")
    assert eagle.model == "/m/q" and eagle.drafter_path == "REPLACE-ME/eagle3-head-of-qwen2.5-7b"
    assert engine_facts(load_config("default", overrides=["drafters.0.kind=ngram"]), None, "/x").drafter_path is None
    assert default_trace_dir(tmp_path / "a" / "p.json") == tmp_path / "a" / "p-traces"
