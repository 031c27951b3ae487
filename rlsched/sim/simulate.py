"""Run a simulation end to end and summarise it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import simpy

from rlsched.config import SimConfig
from rlsched.costs.choose import cost_model_for
from rlsched.policies.draft import PolicyContext
from rlsched.policies.realloc import make_realloc_policy
from rlsched.policies.registry import PolicySpec, as_spec, make_draft_policy
from rlsched.sim.cluster import kv_capacity
from rlsched.sim.rlstep import StepRecord, TrueAcceptance, rl_run
from rlsched.sim.sizes import check_fits
from rlsched.sim.timeline import KIND_PREFILL, KINDS, Timeline
from rlsched.sim.vllm_engine import STATS, VllmInstance
from rlsched.sim.workload import sample_lengths


@dataclass
class SimResult:
    config: SimConfig
    policy: str
    realloc: str
    records: list[StepRecord]
    timeline: Timeline
    kv_capacity: int
    cost: object

    # ------------------------------------------------------------------ tables
    def timeline_frame(self) -> pd.DataFrame:
        cols = self.timeline.arrays()
        names = np.array(["off", *self.records[0].stage.rollout.drafters] if self.records else ["off"], dtype=object)
        df = pd.DataFrame(
            {
                "rl_step": cols["rl_step"],
                "instance": cols["instance"],
                "step": cols["step"],
                "time_s": cols["t_start"],
                "kind": np.asarray(KINDS, dtype=object)[cols["kind"]],
                "batch": cols["batch"],
                "drafter": names[cols["drafter"] + 1],
                "k": cols["k"],
                "width": cols["width"],
                "drafted": cols["drafted"],
                "accepted": cols["accepted"],
                "emitted": cols["emitted"],
                "draft_ms": cols["draft_s"] * 1e3,
                "verify_ms": cols["verify_s"] * 1e3,
                "step_ms": (cols["draft_s"] + cols["verify_s"]) * 1e3,
                "ctx_tokens": cols["ctx_tokens"],
            }
        )
        df.loc[df["kind"] == "prefill", "drafter"] = None
        return df

    def samples_frame(self) -> pd.DataFrame:
        frames = []
        for r in self.records:
            st, ro = r.stage, r.stage.rollout
            d = {
                "rl_step": r.rl_step,
                "sample_id": np.arange(ro.n),
                "prompt_id": ro.prompt_of,
                "instance": st.instance_of,
                "prompt_len": ro.prompt_len,
                "response_len": ro.response_len,
                "finish_s": st.t_finish,
                "preemptions": st.preemptions,
                "migrations": st.migrations,
            }
            for j, name in enumerate(ro.drafters):
                d[f"acceptance_{name}"] = ro.acceptance[:, j]
            frames.append(pd.DataFrame(d))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def steps_frame(self) -> pd.DataFrame:
        rows = []
        for r in self.records:
            row = {
                "rl_step": r.rl_step,
                "generation_s": r.generation_s,
                "inference_s": r.inference_s,
                "training_s": r.training_s,
                "drafter_update_s": r.drafter_update_s,
                "total_s": r.total_s,
                "prompt_tokens": r.prompt_tokens,
                "response_tokens": r.response_tokens,
            }
            row.update({f"accept_mean_{k}": v for k, v in r.accept_means.items()})
            rows.append(row)
        return pd.DataFrame(rows)

    # ------------------------------------------------------------------ summary
    def summary(self) -> dict:
        recs = self.records
        gen = float(sum(r.generation_s for r in recs))
        total = float(sum(r.total_s for r in recs))
        tokens = int(sum(r.response_tokens for r in recs))
        busy = np.zeros(self.config.cluster.instances)
        steps = 0
        for r in recs:
            for inst in r.stage.instances:
                busy[inst.idx] += inst.busy
                steps += inst.steps
        out = {
            "name": self.config.name,
            "policy": self.policy,
            "realloc": self.realloc,
            "seed": self.config.seed,
            "rl_steps": len(recs),
            "instances": self.config.cluster.instances,
            "samples_per_step": recs[0].stage.rollout.n if recs else 0,
            "kv_capacity_tokens": self.kv_capacity,
            "generation_s": gen,
            "generation_s_per_step": [r.generation_s for r in recs],
            "tokens_per_s": tokens / gen if gen > 0 else 0.0,
            "response_tokens": tokens,
            "engine_steps": steps,
            "idle_fraction": [float(1 - b / gen) if gen > 0 else 0.0 for b in busy],
            "rl_step_s": total,
            "time_split": {
                "generation": gen / total if total else 0.0,
                "inference": sum(r.inference_s for r in recs) / total if total else 0.0,
                "training": sum(r.training_s for r in recs) / total if total else 0.0,
                "drafter_update": sum(r.drafter_update_s for r in recs) / total if total else 0.0,
            },
            "preemptions": int(sum(int(r.stage.preemptions.sum()) for r in recs)),
            "migrations": int(sum(sum(m[3] for m in r.stage.migration_log) for r in recs)),
            "freed_gpu_s": float(sum(r.stage.freed_gpu_s for r in recs)),  # sum of (stage end - freed) x tp
        }
        if self.config.engine.kind == "vllm":  # the vLLM engine's token counts (sim/vllm_engine.py)
            parts = [i.stats for r in recs for i in r.stage.instances if isinstance(i, VllmInstance)]
            stats = sum(parts, np.zeros(len(STATS), dtype=np.int64))
            out["vllm_engine"] = dict(zip(STATS, stats.tolist()))
        if self.timeline.enabled and len(self.timeline):
            c = self.timeline.arrays()
            dec = c["kind"] != KIND_PREFILL  # decode/verify rows: decode and mixed steps
            sd = dec & (c["drafter"] >= 0)
            out["decode_steps"] = int(dec.sum())
            out["sd_step_fraction"] = float(sd.sum() / max(1, dec.sum()))
            # tokens per sequence per verify: 1 + accepted drafts (SD steps only)
            out["mean_accept_len"] = float(c["emitted"][sd].sum() / c["batch"][sd].sum()) if sd.any() else 1.0
            out["tokens_per_seq_step"] = float(c["emitted"][dec].sum() / max(1, c["batch"][dec].sum()))
            ks = c["k"][dec]
            out["k_histogram"] = {int(k): int(n) for k, n in zip(*np.unique(ks, return_counts=True))}
        return out


def policy_context(cfg: SimConfig, cost=None, true_acceptance=None) -> PolicyContext:
    """What policies may know of a config before it runs (cost=None: for name checks only)."""
    rng = np.random.default_rng(0)
    prompt = sample_lengths(cfg.workload.prompt_len, 4096, 1, rng).mean()
    response = sample_lengths(cfg.workload.response_len, 4096, 1, rng).mean()
    return PolicyContext(
        cost=cost,
        drafters=tuple(d.name for d in cfg.drafters),
        k_max=cfg.speculation.k_max,
        max_batch=cfg.cluster.max_batch,
        typical_ctx=int(prompt + response / 2),
        acceptance_prior={d.name: d.acceptance.mean for d in cfg.drafters},
        seed=cfg.seed,
        tree_gain={d.name: d.acceptance.tree_gain for d in cfg.drafters},
        tree_top1={d.name: d.acceptance.tree_top1 for d in cfg.drafters},
        position_decay={d.name: d.acceptance.position_decay for d in cfg.drafters},
        width_max=cfg.speculation.width_max,
        nodes_max=cfg.speculation.nodes_max,
        identity=config_identity(cfg),
        true_acceptance=true_acceptance,
    )


def config_identity(cfg: SimConfig) -> dict:
    return {
        "model": cfg.model.name,
        "hardware": cfg.hardware.name,
        "tp": cfg.cluster.tp,
        "drafters": [d.name for d in cfg.drafters],
    }


def simulate(
    cfg: SimConfig, policy: PolicySpec | str | None = None, realloc: str | None = None, progress=None, cost=None
) -> SimResult:
    """Simulate cfg.rl.steps RL steps with a drafting policy (default: the config's) and a
    reallocation policy.

    `cost` defaults to the config's: its analytic roofline, or its fitted `cost_file`. A run this
    machine's memory cannot hold is refused before any work (`sim/sizes.py`).
    """
    policy = as_spec(policy) if policy else cfg.speculation.policy
    check_fits(cfg, policy=policy)
    realloc_name = realloc or cfg.cluster.realloc
    cost = cost or cost_model_for(cfg)
    truth = TrueAcceptance()
    ctx = policy_context(cfg, cost, truth)
    make_draft_policy(policy, ctx)  # validate the name before any work
    ctx.shared.clear()
    realloc_policy = make_realloc_policy(realloc_name)
    capacity = kv_capacity(cfg, cost)
    env = simpy.Environment()
    timeline = Timeline(enabled=cfg.record_timeline)
    records: list[StepRecord] = []
    make = lambda: [make_draft_policy(policy, ctx) for _ in range(cfg.cluster.instances)]  # noqa: E731
    env.process(rl_run(env, cfg, cost, make, realloc_policy, timeline, records, capacity, progress, truth))
    env.run()
    return SimResult(cfg, policy.text, realloc_name, records, timeline, capacity, cost)
