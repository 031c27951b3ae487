"""A plan's winner written as files people run, and the plan's record.

- `sim.yaml`: the winner as a simulator config (`rlsched simulate --config`);
- `run.yaml`: an `rlsched run` config: the job's algorithm (PPO where the RL step has a critic,
  else GRPO; no KL term where it has no reference), bf16 on CUDA for a GPU (the run's own
  device and dtype for a plan from a run), vLLM rollouts with the winner's instances, tp,
  memory fraction, batch limit, draft policy and reallocation, and the drafter's update
  schedule (model and drafter: the folders given to the planner; an EAGLE-3 head not given is
  a placeholder, `EAGLE_PLACEHOLDER`, the user replaces);
- `vllm_engine.json`, `vllm_serve.sh`, `openrlhf_launch.py`: one rollout instance's vLLM engine
  (`policies/engine_args.py`): tensor parallelism, `max_num_seqs`, `gpu_memory_utilization`,
  the window, the dtype, the drafter's `speculative_config` (`num_speculative_tokens`: the
  longest draft the policy may choose), and rlsched's scheduler running the winner's policy
  itself in vLLM (`engine_policy`, priced by `engine_cost_model`), and, where the plan ran
  vLLM's engine model (`engine.kind: vllm`), the scheduling knobs it simulated (`engine_knobs`:
  the token budget, chunked prefill, prefix caching, capture sizes), as `vllm.LLM`'s arguments,
  a `vllm serve` command and OpenRLHF's trainer launcher; vLLM drafts chains, so a winner that
  also drafts trees runs its policy over chains there;
- `verl_rollout.yaml`: the same engine as verl's `actor_rollout_ref.rollout` section (the
  scheduler and the speculative config through `engine_kwargs.vllm`), with the job's samples
  per prompt and lengths, and the actor's FSDP offload where the winner offloads training's
  states;
- `plan.json` and `candidates.csv`: every candidate with its screen and simulated numbers,
  and why the dropped ones cannot run; `summary.json`: the key numbers (`rlsched report`).
"""

from __future__ import annotations

from rlsched.config import SimConfig, length_max, preset_names
from rlsched.engine_config import VLLM_BLOCK_SIZE
from rlsched.plan.feasible import longest_sequence
from rlsched.plan.space import Candidate
from rlsched.policies.engine_args import (
    EAGLE_PLACEHOLDER,
    METHODS,
    EngineFacts,
    HookSettings,
    verl_rollout_section,
    vllm_engine_kwargs,
)
from rlsched.policies.registry import PolicySpec, make_draft_policy, parse_policy
from rlsched.sim.simulate import policy_context

# the cost model written where a priced policy runs on hardware that is not a preset and no cost file
# was given: the user replaces it with a `rlsched fit` file of the served model on that hardware
COST_PLACEHOLDER = "REPLACE-ME/rlsched-fit-on-{hardware}.json"
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


def engine_policy(cfg: SimConfig, c: Candidate, cost) -> PolicySpec:
    """The candidate's policy as an engine runs it: static:K, twostate:MAX_BATCH:K (solved
    over `cost`), goodput, a learned table or off."""
    if c.policy.family == "static":
        return parse_policy(f"static:{c.policy.k}")
    if c.policy.family == "twostate" and c.policy.priced:  # solved here, written as its threshold and k
        two = make_draft_policy(c.policy, policy_context(cfg, cost))
        return parse_policy(f"twostate:{two.max_batch_on}:{two.k}")
    return c.policy


def engine_cost_model(cfg: SimConfig, policy: PolicySpec) -> str | None:
    """What the engine prices `policy` with: the config's cost file (a plan's copy), else its
    hardware preset (the served model's roofline there); where the hardware is not a preset, a
    marked placeholder for a priced policy (`COST_PLACEHOLDER`) and nothing for another."""
    if cfg.cost_file:
        return cfg.cost_file
    if cfg.hardware.name in preset_names("hardware"):
        return cfg.hardware.name
    return COST_PLACEHOLDER.format(hardware=cfg.hardware.name) if policy.priced else None


def engine_knobs(cfg: SimConfig) -> dict:
    """EngineFacts' scheduling knobs of a config that runs vLLM's engine model, as it simulated
    them: the token budget (vLLM's default for the GPU where it sets none: `vllm serve`'s own
    default differs), chunked prefill, prefix caching, the capture sizes where set, async
    scheduling where set and the block size where not vLLM's; {} under rlsched's engine."""
    e = cfg.engine
    if e.kind != "vllm":
        return {}
    hw = cfg.hardware
    budget = e.resolve(hw.memory_gib, hw.name, cfg.cluster.max_batch, False).max_num_batched_tokens
    sizes = e.cudagraph_capture_sizes
    return dict(
        max_num_batched_tokens=budget,
        enable_chunked_prefill=e.enable_chunked_prefill,
        enable_prefix_caching=e.enable_prefix_caching,
        cudagraph_capture_sizes=None if sizes is None else tuple(sizes),
        async_scheduling=e.async_scheduling,
        block_size=None if e.block_size == VLLM_BLOCK_SIZE else e.block_size,
    )


def vllm_engine_args(
    cfg: SimConfig,
    c: Candidate,
    cost,
    model: str,
    drafter: str,
    *,
    policy: str | None = None,
    trace_dir: str | None = None,
    dtype: str | None = None,
) -> dict:
    """vLLM engine arguments of one rollout instance of the candidate (`engine_args.
    vllm_engine_kwargs`): its tp, batch limit, memory and drafter, the workload's longest
    sequence as the window, vLLM's scheduling knobs as `cfg` (the candidate's config) sets them
    (`engine_knobs`), and rlsched's scheduler running `engine_policy` (`policy`: the text
    the engine reads instead, such as the plan's copy of a learned policy file), its traces in
    `trace_dir`; `dtype` as run.yaml has it (default: `run_device`'s). UserError, one line, for
    what cannot run."""
    kind = cfg.drafter(c.drafter).kind if c.drafter is not None else "off"
    facts = EngineFacts(
        model=model,
        drafter=kind,
        drafter_path=drafter if kind in METHODS else None,
        k_max=cfg.speculation.k_max,
        max_num_seqs=c.max_batch,
        tensor_parallel_size=c.tp,
        gpu_memory_utilization=c.memory,
        max_model_len=longest_sequence(cfg),
        dtype=dtype or run_device(cfg)["dtype"],
        **engine_knobs(cfg),
    )
    spec = engine_policy(cfg, c, cost)
    kw = vllm_engine_kwargs(facts, HookSettings(spec.text, engine_cost_model(cfg, spec), trace_dir))
    if policy is not None:
        kw["additional_config"]["rlsched"]["policy"] = policy
    return kw


def verl_nodes(gpus: int, per_node: int = 8) -> dict:
    """verl's trainer.nnodes x n_gpus_per_node for `gpus` GPUs, exactly: the most GPUs a node
    (at most `per_node`) that divide them evenly."""
    most = max(d for d in range(1, min(per_node, gpus) + 1) if gpus % d == 0)
    return {"n_gpus_per_node": most, "nnodes": gpus // most}


def verl_rollout(cfg: SimConfig, c: Candidate, engine: dict) -> dict:
    """verl's settings for the candidate: the rollout section of its engine (`engine_args.
    verl_rollout_section`) with the job's samples per prompt, temperature and lengths, the
    advantage estimator, the data's batch and lengths and the trainer's GPUs (the candidate's)."""
    w = cfg.workload
    rollout = verl_rollout_section(engine)["actor_rollout_ref"]["rollout"]
    rollout.update(
        n=w.samples_per_prompt,
        temperature=1.0,
        prompt_length=length_max(w.prompt_len),
        response_length=length_max(w.response_len),
    )
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
        "trainer": verl_nodes(c.gpus),
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
