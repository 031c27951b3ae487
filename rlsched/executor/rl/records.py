"""What an RL run writes besides the backend's traces: one `rl_steps` record per step, the
step's samples (`rollouts/step-NNNNNN.parquet`) and, at the end, `summary.json` (the command
adds the run's plots to it: the executor never imports `analysis`)."""

from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import torch

from rlsched.executor.rl.checkpoint import SUMMARY

POOL_COUNTS = ("migrated", "migrated_kv", "migrated_reprefill", "requeued", "instances_died")
TRAIN_STATS = ("loss", "kl_ref", "clip_frac", "approx_kl_old", "grad_norm", "value_loss")
STAGES = ("generation", "inference", "training", "drafter_update")


def step_record(
    s: int, requests, result, rb, times: dict, train_stats: dict, distill_stats: dict | None, estimator, drafter_names
) -> dict:
    """Step `s`'s `rl_steps` record: stage `times` (seconds), tokens, acceptance, rewards, the
    update's statistics; `estimator`: the backend's (None: no acceptance means)."""
    st = result.stats
    rewards = rb.rewards[~rb.failed]
    nan = float("nan")
    rec = dict(
        rl_step=s,
        **times,
        prompt_tokens=sum(len(q.prompt) for q in requests),
        response_tokens=int(st["tokens"]),
        reward_mean=float(rewards.mean()) if len(rewards) else nan,
        reward_std=float(rewards.std()) if len(rewards) else nan,
        reward_failures=int(rb.failed.sum()),
        samples=len(result.samples),
        response_len_mean=st["tokens"] / max(1, st["samples"]),
        tokens_per_s=st["tokens_per_s"],
        engine_steps=st["steps"],
        drafted=st["drafted"],
        accepted=st["accepted"],
        mean_accept_len=st["mean_accept_len"],
        accept_rate=st["accepted"] / st["drafted"] if st["drafted"] else nan,
        drafter_kl_before=nan if distill_stats is None else distill_stats["kl_before"],
        drafter_kl_after=nan if distill_stats is None else distill_stats["kl_after"],
    )
    for k in POOL_COUNTS:
        if k in st:  # a pool of instances
            rec[k] = int(st[k])
    for name in drafter_names:
        rec[f"accept_mean_{name}"] = float(estimator.mean(name)) if estimator is not None else nan
    for k in TRAIN_STATS:
        rec[k] = train_stats.get(k, nan)
    return rec


def write_rollout(out: Path, s: int, items, requests, group, result, texts, rb) -> None:
    """Step `s`'s samples: prompt, response, length, reward, accepted length."""
    from rlsched.traces.writer import write_table

    df = pd.DataFrame(
        dict(
            rl_step=s,
            prompt_id=[q.prompt_id for q in requests],
            sample_id=[q.sample_id for q in requests],
            prompt=[items[g].prompt for g in group],
            response=texts,
            response_len=[len(x.tokens) for x in result.samples],
            reward=rb.rewards,
            reward_failed=rb.failed,
            mean_accept_len=[x.mean_accept_len for x in result.samples],
        )
    )
    write_table(out / "rollouts" / f"step-{s:06d}.parquet", pa.Table.from_pandas(df, preserve_index=False))


def write_summary(out: Path, cfg, drafter_name: str, model_dir: Path) -> dict:
    """summary.json, from the RL-step trace. Returns the summary."""
    from rlsched.executor.model.loading import load_config
    from rlsched.traces.reader import read_trace

    df = read_trace(out / "traces", "rl_steps").sort_values("rl_step")
    head, tail = df.head(max(1, len(df) // 5)), df.tail(max(1, len(df) // 5))
    summary = dict(
        steps=int(len(df)),
        reward_start=float(head["reward_mean"].mean()),
        reward_end=float(tail["reward_mean"].mean()),
        accept_len_start=float(head["mean_accept_len"].mean()),
        accept_len_end=float(tail["mean_accept_len"].mean()),
        seconds=float(df["total_s"].sum()),
        stage_s={k: float(df[f"{k}_s"].sum()) for k in STAGES},
        tokens_per_s=float(df["response_tokens"].sum() / df["generation_s"].sum()),
        policy=cfg.policy.text,
        drafter=drafter_name,
        algorithm=cfg.algorithm.name,
        model=str(model_dir),
        model_shape=load_config(model_dir).shape,
        seed=cfg.seed,
        machine=platform.node(),
        threads=torch.get_num_threads(),
        created_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        out=str(out),
        traces=str(out / "traces"),
    )
    return save_summary(out, summary)


def save_summary(out: Path, summary: dict) -> dict:
    """Write `summary` (NaN as null) to out/summary.json, atomically. Returns what was written."""
    from rlsched.atomic import write_text_atomic

    summary = _finite(summary)
    write_text_atomic(out / SUMMARY, json.dumps(summary, indent=2) + "\n")
    return summary


def _finite(x):
    """JSON has no NaN: None instead (a run without speculation has no acceptance rate)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x
