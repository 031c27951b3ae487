"""Everything an RL run needs, built from its RunConfig: `build(cfg, out)`.

The out folder is locked first (`rlsched.locks`: one command at a time per folder, held until
the process ends). Every input is checked before anything is written (the out folder, whose
temporaries left by killed writes are then removed; the policy and its cost model folder,
before any model is loaded; the data, the reward, the model and drafter folders), then the
run's state is restored from its checkpoint (on resume), the drafter and the draft policy are
made (profiling step costs first when the policy prices them and no profile is given), the out
folder is prepared and the rollout backend started: rlsched's own engine in this process, a Ray
pool of them, or vLLM. A write that fails there for want of room or permission ends the run in
one line (`write_failed`).
"""

from __future__ import annotations

import copy
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import yaml

from rlsched.errors import UserError
from rlsched.executor.backends import BackendConfig, RolloutBackend, make_backend
from rlsched.executor.decode.drafters import drafter_cache_len
from rlsched.executor.folders import WriteFailed, is_leftover, remove_leftovers, writing
from rlsched.executor.prompts import encode
from rlsched.executor.rl.checkpoint import SUMMARY, TrainState, restore, rewind_out
from rlsched.executor.rl.config import RunConfig
from rlsched.executor.setup import (
    PROFILE,
    Models,
    check_cost_folder,
    check_policy_model,
    check_width_max,
    cost_model,
    drafter_kind,
    load_models,
    make_drafter,
    needs_cost,
)
from rlsched.locks import hold
from rlsched.policies.drafters import drafter_names
from rlsched.policies.registry import run_words


@dataclass
class Setup:
    """What `build` hands the Trainer."""

    source: Any  # data.PromptSource
    reward_fn: Any  # rewards.Reward
    tokenizer: Any
    eos: int | None
    pad_id: int
    drafter_name: str  # off, ngram or model
    model_dir: Path  # the target's folder
    state: TrainState  # restored on resume
    reference: torch.nn.Module | None  # the KL penalty's frozen start model
    start_step: int
    longest: int  # the longest prompt the caches are sized for, in tokens
    backend: RolloutBackend
    out_existed: bool = False  # `out` was there before the run: empty, or an earlier finished run


def build(cfg: RunConfig, out: Path, *, resume: bool = False, log=None) -> Setup:
    """Lock `out` (until the process ends; at once again if building fails), check, load,
    restore, profile, then prepare `out` and start the rollout backend."""
    lock = hold(out, "run")
    try:
        return _build(cfg, Path(out), resume, log or (lambda msg: None))
    except BaseException:
        lock.release()
        raise


def _build(cfg: RunConfig, out: Path, resume: bool, log) -> Setup:
    from rlsched.executor.decode.sampling import SamplingParams
    from rlsched.executor.rl.data import make_source
    from rlsched.executor.rl.rewards import resolve_reward

    r = cfg.rollout
    existed = check_out(out, resume)
    check_policy_inputs(cfg)  # from the config alone, before anything is loaded
    if r.instances > 1:
        from rlsched.executor.pool.instances import require_ray

        require_ray()  # Ray installed, RAY_ADDRESS's cluster up: before profiling and writing
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    source = make_source(cfg.data, cfg.seed)
    reward_fn = resolve_reward(cfg.reward, device=cfg.device)
    m = load_models(cfg.model, cfg.drafter, device=cfg.device, dtype=cfg.dtype, log=log)
    check_policy_model(cfg.policy, m.target_dir, m.target.config)
    sampling = SamplingParams(temperature=r.temperature)
    reference = copy.deepcopy(m.target) if cfg.algorithm.kl_coef > 0 else None
    state = new_state(cfg, m.target, m.drafter_model)
    start_step, saved = restore(out, cfg.model_dump(), state) if resume else (0, None)
    one = r.instances == 1  # one engine in this process: rlsched's, or vLLM's (its policy_state is alike)
    restored, estimator, history = saved if one and saved is not None else (None, None, None)
    longest = longest_prompt(source, m.tokenizer)
    drafter = make_drafter(
        m,
        sampling,
        r.max_batch,
        drafter_cache_len(longest, r.max_tokens, r.k_max),
        state.generator,
        ngram_history=2 * r.group_size,
        history=history,
    )
    policy, cost, profile = restored, None, None
    typical = typical_context(cfg, source, m.tokenizer)
    if restored is None:
        policy, cost, profile = make_policy(cfg, m, drafter, sampling, typical, out, log)
    try:
        with writing(out):
            if resume:
                remove_leftovers(out)  # of writes killed mid-way: under the lock, no live writer owns them
                rewind_out(out, start_step)
                log(f"resuming {out} at step {start_step}")
            else:
                new_out(out, cfg)
            if profile is not None:
                from rlsched.traces.writer import write_table

                write_table(out / PROFILE, pa.Table.from_pandas(profile, preserve_index=False))
            backend = make_backend(
                backend_config(cfg, longest, out, typical),
                m,
                drafter,
                sampling,
                policy,
                cost=cost,
                generator=state.generator,
                estimator=estimator,
                send_weights=True,
                states=None if one else saved,
                log=log,
            )
    except WriteFailed as e:
        raise write_failed(e, out, resumable=resume, existed=existed) from None
    return Setup(
        source,
        reward_fn,
        m.tokenizer,
        m.eos,
        m.pad_id,
        m.drafter_name,
        m.target_dir,
        state,
        reference,
        start_step,
        longest,
        backend,
        existed,
    )


# --- the out folder ----------------------------------------------------------------------------


def check_out(out: Path, resume: bool) -> bool:
    """Refuse an --out that holds no run to resume, is a file, holds an unfinished run (without
    --resume) or is a non-empty folder that is not an earlier run (temporaries left by killed
    writes do not count). Whether `out` is there."""
    if resume:
        if not (out / "config.yaml").is_file():
            raise UserError(f"--resume: {out} holds no run (no config.yaml); give the --out of an earlier run")
        return True
    if out.exists():
        if not out.is_dir():
            raise UserError(f"--out {out} is a file; give a folder")
        if any(not is_leftover(p) for p in out.iterdir()):
            if (out / "config.yaml").is_file() and not (out / SUMMARY).is_file():
                raise UserError(
                    f"--out {out} holds an unfinished run; pass --resume to continue it, or give another --out"
                )
            if not (out / SUMMARY).is_file():
                raise UserError(
                    f"--out {out} is a non-empty folder that is not an earlier run; give a new or empty folder"
                )
    return out.exists()


def new_out(out: Path, cfg: RunConfig) -> None:
    """An empty `out` (an earlier finished run there is replaced) with the run's config.yaml."""
    from rlsched.atomic import write_text_atomic

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    write_text_atomic(out / "config.yaml", yaml.safe_dump(cfg.model_dump(), sort_keys=False))


def write_failed(e: WriteFailed, out: Path, resumable: bool, existed: bool) -> UserError:
    """The one line ending a run whose write failed for want of room or permission. A run that
    can continue (it has a checkpoint, or was resumed) keeps its folder for --resume; one that
    failed before its first checkpoint leaves nothing: its folder is removed (emptied, when it
    was there before the run)."""
    if resumable:
        return UserError(
            f"writing {e.path} failed ({e.reason}); {e.fix}, then continue with `rlsched run --resume --out {out}`"
        )
    discard_out(out, existed)
    return UserError(
        f"writing {e.path} failed ({e.reason}) before the run's first checkpoint; {out} was "
        f"{'emptied' if existed else 'removed'}: {e.fix}, then run again"
    )


def discard_out(out: Path, keep_folder: bool) -> None:
    """Remove what the run wrote to `out`, and `out` itself unless `keep_folder`."""
    if not keep_folder:
        shutil.rmtree(out, ignore_errors=True)
        return
    for p in out.iterdir() if out.is_dir() else []:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


# --- the trainer's state -----------------------------------------------------------------------


def new_state(cfg: RunConfig, actor, drafter_model) -> TrainState:
    """The optimizers, PPO's critic (a copy of the actor with a value head), the replay
    buffer and the drafter schedule of a fresh run."""
    from rlsched.executor.rl.distill import ReplayBuffer
    from rlsched.policies.drafter_schedule import DrafterSchedule

    a, d = cfg.algorithm, cfg.drafter_update
    actor_opt = torch.optim.AdamW(actor.parameters(), lr=a.lr, weight_decay=0.0)
    critic = critic_opt = None
    if a.name == "ppo":
        from rlsched.executor.rl.algos import Critic

        critic = Critic(copy.deepcopy(actor), actor.config.hidden_size).to(cfg.device)
        critic.requires_grad_(False)
        critic_opt = torch.optim.AdamW(critic.parameters(), lr=a.critic_lr, weight_decay=0.0)
    drafter_opt = None
    if drafter_model is not None:
        drafter_opt = torch.optim.AdamW(drafter_model.parameters(), lr=d.lr, weight_decay=0.0)
    return TrainState(
        actor,
        actor_opt,
        critic,
        critic_opt,
        drafter_model,
        drafter_opt,
        ReplayBuffer(d.buffer_steps),
        DrafterSchedule(d.schedule, d.every, cfg.steps),
        torch.Generator(device=cfg.device),
    )


# --- the policy and its cost model --------------------------------------------------------------


def check_policy_inputs(cfg: RunConfig) -> None:
    """The policy (the backend's own, for vLLM) and the cost model folder it is priced by, in
    the run's words: from the config alone, before any model is loaded."""
    r = cfg.rollout
    kind = drafter_kind(cfg.drafter)
    check_width_max(r.width_max, kind, r.backend, "rollout.width_max")
    if r.backend == "vllm":
        from rlsched.executor.vllm.spec import check_vllm_backend

        check_vllm_backend(cfg.policy, kind, k_max=r.k_max, max_batch=r.max_batch, cost_model=cfg.cost_model)
        return
    cfg.policy.check(drafter_names(kind), r.k_max, run_words(r.backend))
    if needs_cost(cfg.policy, r.instances, r.realloc):
        check_cost_folder(cfg.cost_model, "cost_model")


def longest_prompt(source, tokenizer) -> int:
    """Prompts are drawn per step; the caches are sized for the longest seen in a sweep of
    the data (grown later if a longer one comes)."""
    n = source.size if source.size is not None else 256
    return max((len(encode(tokenizer, i.prompt)) for i in source.batch(0, min(n, 256))), default=1)


def typical_context(cfg: RunConfig, source, tokenizer) -> int:
    """The first step's mean prompt length plus half the token budget."""
    items = source.batch(0, cfg.rollout.prompts_per_step)
    return int(np.mean([len(encode(tokenizer, i.prompt)) for i in items]) + cfg.rollout.max_tokens / 2)


def make_policy(cfg: RunConfig, m: Models, drafter, sampling, typical_ctx: int, out: Path, log):
    """(policy, cost model, profile records to save): rlsched's engine's policy, built over a
    cost model when it or a pool's migrations are priced (a given folder's, the run's own
    start-up profile on resume, or a short profile now); for vLLM the policy's name and a
    given folder's cost model (without one, vLLM's engine measures its own at start-up)."""
    from rlsched.executor.engine.rollout import build_policy

    r = cfg.rollout
    if r.backend == "vllm":
        given = cfg.cost_model != "auto" and needs_cost(cfg.policy, r.instances, r.realloc)
        cost = (
            cost_model(
                cfg.policy,
                cfg.cost_model,
                None,
                None,
                sampling,
                instances=r.instances,
                realloc=r.realloc,
                max_batch=r.max_batch,
                k_max=r.k_max,
                typical_ctx=typical_ctx,
                seed=cfg.seed,
            )[0]
            if given
            else None
        )
        return cfg.policy, cost, None
    cost, records = cost_model(
        cfg.policy,
        cfg.cost_model,
        m.target,
        drafter,
        sampling,
        instances=r.instances,
        realloc=r.realloc,
        max_batch=r.max_batch,
        k_max=r.k_max,
        typical_ctx=typical_ctx,
        seed=cfg.seed,
        saved=out / PROFILE,
        log=log,
        width_max=r.width_max,
    )
    policy = build_policy(
        cfg.policy,
        m.drafter_names,
        cost,
        run_words(r.backend),
        k_max=r.k_max,
        max_batch=r.max_batch,
        typical_ctx=typical_ctx,
        width_max=r.width_max,
        nodes_max=r.k_max,
    )
    return policy, cost, records


# --- the rollout backend -------------------------------------------------------------------------


def backend_config(cfg: RunConfig, longest: int, out: Path, typical_ctx: int | None = None) -> BackendConfig:
    """The run's rollout backend, sized for prompts of `longest` tokens: rlsched's own engine
    (one in this process, or rollout.instances of them on Ray, sharing the cores) or vLLM's."""
    r = cfg.rollout
    threads = max(1, (cfg.threads or os.cpu_count() or 1) // r.instances)  # the instances share the cores
    if r.backend == "vllm" and r.instances == 1:
        threads = cfg.threads  # vLLM in this process: the run's own setting
    return BackendConfig(
        r.backend,
        r.instances,
        cfg.policy,
        r.max_batch * (longest + r.max_tokens),
        r.max_batch,
        r.k_max,
        drafter_cache_len(longest, r.max_tokens, r.k_max),
        out / "traces",
        cfg.device,
        cfg.dtype,
        threads,
        realloc=r.realloc,
        threshold=r.realloc_threshold,
        seed=cfg.seed,
        ngram_history=2 * r.group_size,
        share_prompts=r.share_prompts,
        probe_every=r.probe_every,
        max_len=longest + r.max_tokens + r.k_max + 1,
        typical_ctx=typical_ctx,
        tp=r.tp,
        gpu_memory_utilization=r.gpu_memory_utilization,
    )
