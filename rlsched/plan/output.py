"""A plan's winner written as files people run, and the plan's record.

- `sim.yaml`: the winner as a simulator config (`rlsched simulate --config`);
- `run.yaml`: an `rlsched run` config: the job's algorithm (PPO where the RL step has a critic,
  else GRPO; no KL term where it has no reference), bf16 on CUDA for a GPU (the run's own
  device and dtype for a plan from a run), vLLM rollouts with the winner's instances, tp,
  memory fraction, batch limit, draft policy and reallocation, and the drafter's update
  schedule (model and drafter: the folders given to the planner; an EAGLE-3 head not given is
  a placeholder, `EAGLE_PLACEHOLDER`, the user replaces);
- `vllm_engine.json`: vLLM engine arguments of one rollout instance (`vllm.LLM(**args)`):
  tensor parallelism, `max_num_seqs`, `gpu_memory_utilization` and the `speculative_config`,
  whose draft length is native to vLLM: `num_speculative_tokens` for a fixed K, and a
  per-batch-size table (`num_speculative_tokens_per_batch_size`) for the two-state rule, a
  learned table (its lengths at the drafter's mean acceptance and typical context) and
  for goodput (the k of the most tokens a second at each batch size, at the drafter's mean
  acceptance and the workload's typical context; vLLM drafts chains, so a winner that also
  drafts trees is written as its chains);
- `verl_rollout.yaml`: the same as verl's `actor_rollout_ref.rollout` section, the speculative
  config passed through `engine_kwargs.vllm` (and the actor's FSDP offload where the winner
  offloads training's states);
- `plan.json` and `candidates.csv`: every candidate with its screen and simulated numbers,
  and why the dropped ones cannot run; `summary.json`: the key numbers (`rlsched report`).
"""

from __future__ import annotations

import numpy as np

from rlsched.config import SimConfig
from rlsched.plan.feasible import length_max
from rlsched.plan.fluid import Strategies
from rlsched.plan.space import Candidate
from rlsched.policies.registry import PolicySpec, make_draft_policy, parse_policy
from rlsched.policies.vllm_plan import NGRAM, TABLE_FIELD, speculative_plan
from rlsched.sim.simulate import policy_context

METHODS = {"model": "draft_model", "eagle": "eagle3"}
# the drafter written where the winner drafts with an EAGLE-3 head and no --drafter-path names its folder
# (`eagle` alone is the built-in tiny actor's head, for no other model)
EAGLE_PLACEHOLDER = "REPLACE-ME/eagle3-head-of-{model}"
DTYPES = {2: "bfloat16", 4: "float32"}  # the run config's dtype by the model's bytes a weight


def default_drafter_path(cfg: SimConfig, c: Candidate) -> str:
    """The drafter written where none is given: a draft model's preset name (as the actor's),
    a marked placeholder for an EAGLE-3 head's folder, or the kind (ngram, off)."""
    if c.drafter is None:
        return "off"
    d = cfg.drafter(c.drafter)
    if d.kind == "eagle":
        return EAGLE_PLACEHOLDER.format(model=cfg.model.name)
    return d.model.name if d.kind == "model" and d.model is not None else d.kind


def run_device(cfg: SimConfig) -> dict:
    """{device, dtype} of a run on the config's hardware (a GPU) and model."""
    return {"device": "cuda", "dtype": DTYPES.get(cfg.model.dtype_bytes, "bfloat16")}


TIE = 0.01  # a draft length within this share of the best rate's is as good


def engine_policy(cfg: SimConfig, c: Candidate, cost) -> PolicySpec:
    """The candidate's policy as an engine runs it: static:K, twostate:MAX_BATCH:K (solved
    over `cost`), goodput or off."""
    if c.policy.family == "static":
        return parse_policy(f"static:{c.policy.k}")
    if c.policy.family == "twostate" and c.policy.priced:  # solved here, written as its threshold and k
        two = make_draft_policy(c.policy, policy_context(cfg, cost))
        return parse_policy(f"twostate:{two.max_batch_on}:{two.k}")
    return c.policy


def goodput_table(cfg: SimConfig, c: Candidate, cost) -> list[list[int]]:
    """[[start_bs, end_bs, K], ...] for 1..max_batch: the chain of the most tokens a second at
    each batch size, at the drafter's mean acceptance and the workload's typical context."""
    chains = Strategies(
        cfg.model_copy(update={"speculation": cfg.speculation.model_copy(update={"width_max": 1})}), cost, c.drafter
    )
    assert c.drafter is not None  # (a chain's table is a drafter's)
    a = np.array([cfg.drafter(c.drafter).acceptance.mean])
    tokens = chains.tokens(a)[0]
    ctx = policy_context(cfg).typical_ctx
    ranges: list[list[int]] = []
    for b in range(1, c.max_batch + 1):
        rate = tokens / chains.seconds(b, float(b * ctx))
        k = int(np.argmax(rate))
        if ranges and rate[ranges[-1][2]] >= (1 - TIE) * rate[k]:  # a near tie keeps the table short
            k = ranges[-1][2]
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = b
        else:
            ranges.append([b, b, k])
    return ranges


def vllm_engine_args(cfg: SimConfig, c: Candidate, cost, model: str, drafter: str) -> dict:
    """vLLM engine arguments of one rollout instance of the candidate."""
    args = {
        "model": model,
        "tensor_parallel_size": c.tp,
        "max_num_seqs": c.max_batch,
        "gpu_memory_utilization": c.memory,
        "max_model_len": length_max(cfg.workload.prompt_len) + length_max(cfg.workload.response_len),
        "dtype": run_device(cfg)["dtype"],
    }
    if c.drafter is None:
        return args
    kind = cfg.drafter(c.drafter).kind
    policy = engine_policy(cfg, c, cost)
    plan = speculative_plan(policy, kind, k_max=cfg.speculation.k_max, max_batch=c.max_batch)
    assert plan is not None  # (a setup with a drafter drafts)
    table = plan["table"]
    if c.policy.family == "table":  # a learned table: its draft lengths by batch size
        from rlsched.policies.policyfile import load_policy_file
        from rlsched.sim.learn import vllm_table

        pf = load_policy_file(c.policy.file)
        table = vllm_table(pf, c.max_batch, cfg.drafter(c.drafter).acceptance.mean, policy_context(cfg).typical_ctx)[
            TABLE_FIELD
        ]
    elif not plan["native"]:  # goodput: its choice by batch size, as vLLM's own table
        table = goodput_table(cfg, c, cost)
    k = max(e[2] for e in table) if table is not None else plan["k"]
    if k == 0:
        return args
    spec = (
        dict(NGRAM)
        if kind == "ngram"
        else {"method": METHODS[kind], "model": drafter, "draft_sample_method": "probabilistic"}
    )
    spec["num_speculative_tokens"] = k
    if table is not None and any(e[2] != k for e in table):
        spec[TABLE_FIELD] = table
    args["speculative_config"] = spec
    return args


def verl_rollout(cfg: SimConfig, c: Candidate, engine: dict) -> dict:
    """verl's rollout section for the candidate (trainer GPUs: the candidate's)."""
    w = cfg.workload
    rollout = {
        "name": "vllm",
        "tensor_model_parallel_size": c.tp,
        "gpu_memory_utilization": c.memory,
        "max_num_seqs": c.max_batch,
        "max_model_len": engine["max_model_len"],
        "dtype": engine["dtype"],
        "n": w.samples_per_prompt,
        "temperature": 1.0,
        "prompt_length": length_max(w.prompt_len),
        "response_length": length_max(w.response_len),
    }
    if "speculative_config" in engine:
        rollout["engine_kwargs"] = {"vllm": {"speculative_config": engine["speculative_config"]}}
    section = {"rollout": rollout}
    if c.offload:  # training's states leave the GPUs for the rollout
        section["actor"] = {"fsdp_config": {"param_offload": True, "optimizer_offload": True}}
    return {
        "algorithm": {"adv_estimator": "gae" if cfg.rl.critic else "grpo"},
        "actor_rollout_ref": section,
        "data": {
            "train_batch_size": w.prompts,
            "max_prompt_length": length_max(w.prompt_len),
            "max_response_length": length_max(w.response_len),
        },
        "trainer": {"n_gpus_per_node": min(8, c.gpus), "nnodes": max(1, -(-c.gpus // 8))},
    }


def run_config(cfg: SimConfig, c: Candidate, cost, model: str, drafter: str, device: dict | None = None) -> dict:
    """An `rlsched run` config of the job, its rollouts on vLLM set as the candidate; `device`:
    {device, dtype} (default: `run_device`)."""
    w, rl = cfg.workload, cfg.rl
    kind = cfg.drafter(c.drafter).kind if c.drafter is not None else "off"
    algorithm: dict = {"name": "ppo" if rl.critic else "grpo"}
    if not rl.reference:
        algorithm["kl_coef"] = 0.0
    out = {
        "model": model,
        "drafter": drafter if kind in ("model", "eagle") else kind,
        "policy": engine_policy(cfg, c, cost).text,
        **(device or run_device(cfg)),
        "rollout": {
            "backend": "vllm",
            "instances": c.instances,
            "tp": c.tp,
            "gpu_memory_utilization": c.memory,
            "max_batch": c.max_batch,
            "k_max": cfg.speculation.k_max,
            "realloc": c.realloc,
            "group_size": w.samples_per_prompt,
            "prompts_per_step": w.prompts,
            "max_tokens": length_max(w.response_len),
        },
        "algorithm": algorithm,
    }
    if kind in ("model", "eagle"):  # a learned drafter: its update schedule
        out["drafter_update"] = {
            "every": rl.drafter_update_interval,
            "schedule": "pays" if (c.update_schedule or rl.drafter_update_schedule) == "pays" else "every",
        }
    return out
