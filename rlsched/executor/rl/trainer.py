"""The RL loop of `rlsched run`: speculative rollouts, rewards, the update, a fresh drafter.

One RL step (the stages the simulator models, each timed):

1. generation: the step's prompts x group_size samples through the RolloutEngine (adaptive
   speculative decoding; the engine's log-probs are the old policy's);
2. inference: rewards, the reference model's log-probs (KL penalty), the critic's values (PPO);
3. training: GRPO or PPO-clip update(s) of the actor (and the critic);
4. drafter update: the model drafter is distilled from the actor on the replay buffer every
   I steps, or (schedule `pays`) once its staleness has cost the generation stage what an
   update costs; the n-gram drafter indexes the newest rollouts of each prompt by itself.

Every step appends one `rl_steps` record (stage times, tokens, acceptance, rewards) to
`traces/`, next to the engine's step and sample records, and writes its samples to
`rollouts/step-NNNNNN.parquet`. Every `checkpoint_every` steps the whole state goes to
`checkpoint.pt` atomically (actor, drafter, critic, optimizers, the policy and its acceptance
estimates, the replay buffer, the n-gram history, the step). Randomness is a pure function of
(seed, step), so resuming from a checkpoint gives the numbers an uninterrupted run gives
(except where choices read wall-clock times: `bandit`, a calibrating `goodput`, the `pays`
schedule of drafter updates); on
resume, records of steps past the checkpoint are dropped from the traces first.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import platform
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
import yaml

from rlsched.errors import UserError
from rlsched.executor.rl.config import RunConfig
from rlsched.executor.seeds import derive_seed as _seed
from rlsched.policies.drafter_schedule import DrafterSchedule

CHECKPOINT = "checkpoint.pt"
SUMMARY = "summary.json"


def prompt_key(text: str) -> int:
    """A prompt's id across steps and epochs (the n-gram history and acceptance key by it)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _priced_from(folder: Path) -> str | None:
    """What a `cost_model` folder is: a `rlsched profile` output ("profile"), an earlier run
    that profiled at its start ("run"), or neither (None)."""
    if (folder / "profile.parquet").is_file():  # (a run's folder also holds traces/: its own)
        return "run"
    if (folder / "traces").is_dir():
        return "profile"
    return None


class RewardFailures(UserError):
    """Too many samples of a step had no reward: the run stops (its checkpoint stays)."""


class Trainer:
    """Builds everything from a RunConfig (checking all inputs before writing), then `run()`."""

    def __init__(self, cfg: RunConfig, out: Path, *, resume: bool = False, log=None):
        self.cfg, self.out, self.log = cfg, Path(out), log or (lambda msg: None)
        self._check_out(resume)
        if cfg.rollout.instances > 1:
            from rlsched.executor.pool import require_ray

            require_ray()  # Ray installed, RAY_ADDRESS's cluster up: before profiling and writing
        self._load()
        self.start_step = 0
        self.buffer = self._new_buffer()
        self.schedule = DrafterSchedule(cfg.drafter_update.schedule, cfg.drafter_update.every, cfg.steps)
        if resume and (self.out / CHECKPOINT).is_file():
            from rlsched.executor.rl.checkpoint import load_checkpoint

            self._restore(load_checkpoint(self.out / CHECKPOINT))
        self._longest = self._longest_prompt()
        drafter = self._make_drafter()
        policy, estimator, profile = self._make_policy(drafter)  # may profile: still nothing written
        self._prepare_out(resume)
        if profile is not None:
            from rlsched.traces.writer import write_table

            write_table(self.out / "profile.parquet", pa.Table.from_pandas(profile, preserve_index=False))
        self.engine = self._make_engine(drafter, policy, estimator)

    # --- setup: everything checked before anything is written --------------------------------

    def _check_out(self, resume: bool) -> None:
        out = self.out
        if resume:
            if not (out / "config.yaml").is_file():
                raise UserError(f"--resume: {out} holds no run (no config.yaml); give the --out of an earlier run")
            return
        if out.exists():
            if not out.is_dir():
                raise UserError(f"--out {out} is a file; give a folder")
            if any(out.iterdir()):
                if (out / "config.yaml").is_file() and not (out / SUMMARY).is_file():
                    raise UserError(f"--out {out} holds an unfinished run; pass --resume to continue it, "
                                    "or give another --out")
                if not (out / SUMMARY).is_file():
                    raise UserError(f"--out {out} is a non-empty folder that is not an earlier run; "
                                    "give a new or empty folder")

    def _load(self) -> None:
        from rlsched.executor.engine import check_policy, policy_needs_cost
        from rlsched.executor.folders import check_drafter_vocab, eos_id, resolve_model_dir
        from rlsched.executor.loading import load_model
        from rlsched.executor.rl.data import make_source
        from rlsched.executor.rl.rewards import resolve_reward
        from rlsched.executor.sampling import SamplingParams

        c = self.cfg
        if c.threads:
            torch.set_num_threads(c.threads)
        self.source = make_source(c.data, c.seed)
        self.reward_fn = resolve_reward(c.reward, device=c.device)
        self.target_dir = resolve_model_dir(c.model, "target", self.log)
        loaded = load_model(self.target_dir, device=c.device, dtype=c.dtype)
        if loaded.tokenizer is None:
            raise UserError(f"model folder {self.target_dir} has no tokenizer.json, needed to encode prompts")
        self.actor, self.tokenizer = loaded.model, loaded.tokenizer
        self.eos = eos_id(self.target_dir)
        raw = json.loads((self.target_dir / "config.json").read_text())
        pad = raw.get("pad_token_id")
        self.pad_id = pad if isinstance(pad, int) else (self.eos if self.eos is not None else 0)
        self.sampling = SamplingParams(temperature=c.rollout.temperature)
        self.drafter_name, self.drafter_model, self.drafter_dir = c.drafter, None, None
        if c.drafter not in ("off", "ngram"):
            d_dir = resolve_model_dir(c.drafter, "drafter", self.log)
            d = load_model(d_dir, device=c.device, dtype=c.dtype)
            check_drafter_vocab(loaded, d, self.target_dir, d_dir)
            self.drafter_model, self.drafter_name = d.model, "model"
            self.drafter_dir = d_dir
        names = () if self.drafter_name == "off" else (self.drafter_name,)
        self.drafter_names = names
        if c.rollout.backend == "vllm":  # vLLM's own policies: checked before anything is profiled or written
            from rlsched.executor.vllm_backend import check_vllm_backend

            check_vllm_backend(c.policy, self.drafter_dir if self.drafter_name == "model" else self.drafter_name,
                               k_max=c.rollout.k_max, max_batch=c.rollout.max_batch)
        else:
            check_policy(c.policy, names, k_max=c.rollout.k_max)  # before the auto profile prices it
            if policy_needs_cost(c.policy) and c.cost_model != "auto" and not _priced_from(Path(c.cost_model)):
                raise UserError(f"cost_model: {c.cost_model} is neither a `rlsched profile` folder (traces/) nor "
                                "an earlier run's folder (profile.parquet); give one or 'auto'")
        a = c.algorithm
        self.reference = copy.deepcopy(self.actor) if a.kl_coef > 0 else None
        self.actor_opt = torch.optim.AdamW(self.actor.parameters(), lr=a.lr, weight_decay=0.0)
        self.critic = self.critic_opt = None
        if a.name == "ppo":
            from rlsched.executor.rl.algos import Critic

            self.critic = Critic(copy.deepcopy(self.actor), self.actor.config.hidden_size).to(c.device)
            self.critic.requires_grad_(False)
            self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=a.critic_lr, weight_decay=0.0)
        self.drafter_opt = None
        if self.drafter_model is not None:
            self.drafter_opt = torch.optim.AdamW(self.drafter_model.parameters(), lr=c.drafter_update.lr,
                                                 weight_decay=0.0)
        self.generator = torch.Generator(device=c.device)
        self.policy_state = None  # (policy, estimator) restored from a checkpoint
        self.ngram_state = None

    def _new_buffer(self):
        from rlsched.executor.rl.distill import ReplayBuffer

        return ReplayBuffer(self.cfg.drafter_update.buffer_steps)

    def _prepare_out(self, resume: bool) -> None:
        if resume:
            _truncate_traces(self.out / "traces", self.start_step)
            for f in (self.out / "rollouts").glob("step-*.parquet"):
                if int(f.stem.split("-")[1]) >= self.start_step:
                    f.unlink()
            (self.out / SUMMARY).unlink(missing_ok=True)
            self.log(f"resuming {self.out} at step {self.start_step}")
            return
        if self.out.exists():
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True)
        from rlsched.traces.writer import write_text_atomic

        write_text_atomic(self.out / "config.yaml", yaml.safe_dump(self.cfg.model_dump(), sort_keys=False))

    # --- the engine and its policy --------------------------------------------------------

    def _typical_ctx(self) -> int:
        items = self.source.batch(0, self.cfg.rollout.prompts_per_step)
        plen = np.mean([len(self._encode(i.prompt)) for i in items])
        return int(plen + self.cfg.rollout.max_tokens / 2)

    def _cost_model(self, drafter):
        from rlsched.executor.engine import policy_needs_cost
        from rlsched.costs.measured import MeasuredCostModel

        c = self.cfg
        if not (policy_needs_cost(c.policy) or self._realloc_priced):
            return None, None
        if c.cost_model != "auto":
            from rlsched.traces.reader import read_trace

            given = Path(c.cost_model)
            if _priced_from(given) == "run":  # price steps as that run did: its repeat takes the same decisions
                return MeasuredCostModel(pd.read_parquet(given / "profile.parquet")), None
            return MeasuredCostModel(read_trace(given / "traces", "steps")), None
        saved = self.out / "profile.parquet"
        if saved.is_file():  # the run's own profile: a resumed run prices steps as before
            return MeasuredCostModel(pd.read_parquet(saved)), None
        from rlsched.executor.profiler import policy_profile

        records = policy_profile(self.actor, drafter, policy=c.policy, max_batch=c.rollout.max_batch,
                                 k_max=c.rollout.k_max, typical_ctx=self._typical_ctx(), sampling=self.sampling,
                                 seed=c.seed, log=self.log)
        return MeasuredCostModel(records), records

    def _make_drafter(self):
        from rlsched.executor.drafters import ModelDrafter, NgramDrafter, drafter_cache_len

        r = self.cfg.rollout
        if self.drafter_name == "ngram":
            drafter = NgramDrafter(max_history=2 * r.group_size)
            if self.ngram_state is not None:
                drafter.history = self.ngram_state
            return drafter
        if self.drafter_name == "model":
            return ModelDrafter(self.drafter_model, self.sampling, r.max_batch,
                                drafter_cache_len(self._longest, r.max_tokens, r.k_max), self.generator)
        return None

    def _make_policy(self, drafter):
        """(policy, estimator, profile records to save): restored, or built (profiling first
        when the policy prices steps and no profile is given)."""
        from rlsched.executor.engine import build_policy

        self._cost = None  # the cost model priced policies and a pool's migrations use (set below)
        if self.cfg.rollout.backend == "vllm":  # the engine is vLLM's: no local policy, no profile
            return self.cfg.policy, None, None
        if self.policy_state is not None and not isinstance(self.policy_state, list):
            policy, estimator = self.policy_state
            return policy, estimator, None
        r = self.cfg.rollout
        cost, records = self._cost_model(drafter)
        self._cost = cost  # a pool prices its migrations by it too
        policy = build_policy(self.cfg.policy, self.drafter_names, cost, k_max=r.k_max, max_batch=r.max_batch,
                              typical_ctx=self._typical_ctx())
        return policy, None, records

    def _make_engine(self, drafter, policy, estimator):
        """The rollout engine: rlsched's own (one in-process instance, or a Ray pool of them),
        or vLLM's. Every kind has `run(requests) -> RolloutResult`, `rl_step`,
        `sync_weights(actor, drafter_model)` (called after every update) and `close()`."""
        from rlsched.executor.engine import RolloutEngine

        r = self.cfg.rollout
        if r.backend == "vllm":
            from rlsched.executor.vllm_backend import VllmRolloutEngine

            return VllmRolloutEngine(
                self.target_dir, self.drafter_dir if self.drafter_name == "model" else self.drafter_name,
                self.sampling, self.cfg.policy, max_batch=r.max_batch, k_max=r.k_max,
                max_len=self._longest + r.max_tokens + r.k_max + 1, trace_dir=self.out / "traces",
                seed=self.cfg.seed, threads=self.cfg.threads, dtype=self.cfg.dtype)
        if r.instances > 1:
            return self._make_pool(policy)
        return RolloutEngine(self.actor, drafter, r.max_batch * (self._longest + r.max_tokens), r.max_batch,
                             self.sampling, policy, estimator, trace_dir=self.out / "traces", k_max=r.k_max,
                             generator=self.generator, share_prompts=r.share_prompts, probe_every=r.probe_every)

    @property
    def _realloc_priced(self) -> bool:
        r = self.cfg.rollout
        return r.instances > 1 and r.realloc != "none"

    def _make_pool(self, policy):
        """rollout.instances engines as Ray actors, each with the actor's current weights and its
        own copy of the policy (restored per instance on resume)."""
        import os

        from rlsched.executor.drafters import drafter_cache_len
        from rlsched.executor.pool import InstancePool, InstanceSpec

        c, r = self.cfg, self.cfg.rollout
        threads = max(1, (c.threads or os.cpu_count() or 1) // r.instances)  # the instances share the cores
        spec = InstanceSpec(str(self.target_dir), self.drafter_name, None if self.drafter_dir is None else str(self.drafter_dir),
                            self.sampling, policy, r.max_batch * (self._longest + r.max_tokens), r.max_batch, r.k_max,
                            drafter_cache_len(self._longest, r.max_tokens, r.k_max), str(self.out / "traces"),
                            c.device, c.dtype, threads, 2 * r.group_size, r.share_prompts, r.probe_every)
        states = self.policy_state if isinstance(self.policy_state, list) else None
        return InstancePool(r.instances, spec, realloc=r.realloc, threshold=r.realloc_threshold, cost=self._cost,
                            seed=c.seed, target_state=self.actor.state_dict(),
                            drafter_state=None if self.drafter_model is None else self.drafter_model.state_dict(),
                            states=states, log=self.log)

    def _longest_prompt(self) -> int:
        """Prompts are drawn per step; the cache is sized for the longest seen in a sweep of
        the data (grown later if a longer one comes)."""
        n = self.source.size if self.source.size is not None else 256
        items = self.source.batch(0, min(n, 256))
        return max((len(self._encode(i.prompt)) for i in items), default=1)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _decode(self, ids: list[int]) -> str:
        n = self.tokenizer.get_vocab_size()
        return self.tokenizer.decode([i for i in ids if i < n], skip_special_tokens=True)

    # --- checkpoints ----------------------------------------------------------------------------

    def _state(self, next_step: int) -> dict:
        e = self.engine
        return dict(
            version=1, next_step=next_step, config=self.cfg.model_dump(),
            actor=self.actor.state_dict(), actor_opt=self.actor_opt.state_dict(),
            critic=None if self.critic is None else self.critic.state_dict(),
            critic_opt=None if self.critic_opt is None else self.critic_opt.state_dict(),
            drafter=None if self.drafter_model is None else self.drafter_model.state_dict(),
            drafter_opt=None if self.drafter_opt is None else self.drafter_opt.state_dict(),
            policy=(e.policy_state() if hasattr(e, "policy_state")  # a pool: per instance
                    else (getattr(e, "policy", None), getattr(e, "estimator", None))),
            ngram=getattr(getattr(e, "drafters", {}).get("ngram"), "history", None),
            buffer=self.buffer.state(), drafter_schedule=self.schedule.state(),
            rng=dict(torch=torch.get_rng_state(), generator=self.generator.get_state()),
        )

    def _restore(self, s: dict) -> None:
        if s.get("config") != self.cfg.model_dump():
            raise UserError(f"--resume: {self.out / CHECKPOINT} was written with another config; resume with "
                            "the run's own config.yaml (no --config, --policy or --set)")
        self.start_step = int(s["next_step"])
        self.actor.load_state_dict(s["actor"])
        self.actor_opt.load_state_dict(s["actor_opt"])
        if self.critic is not None:
            self.critic.load_state_dict(s["critic"])
            self.critic_opt.load_state_dict(s["critic_opt"])
        if self.drafter_model is not None:
            self.drafter_model.load_state_dict(s["drafter"])
            self.drafter_opt.load_state_dict(s["drafter_opt"])
        self.schedule.load(s.get("drafter_schedule"))
        self.policy_state = s["policy"]
        self.ngram_state = s["ngram"]
        self.buffer.load(s["buffer"])
        torch.set_rng_state(s["rng"]["torch"])
        self.generator.set_state(s["rng"]["generator"])

    def _checkpoint(self, next_step: int) -> None:
        from rlsched.executor.rl.checkpoint import save_checkpoint

        save_checkpoint(self.out / CHECKPOINT, self._state(next_step))

    # --- one RL step -------------------------------------------------------------------------

    def step(self, s: int) -> dict:
        from rlsched.executor.engine import Request
        from rlsched.executor.rl.rewards import RewardInput

        c, r = self.cfg, self.cfg.rollout
        t_start = time.perf_counter()
        items = self.source.batch(s, r.prompts_per_step)
        prompts = [self._encode(i.prompt) for i in items]
        n = r.prompts_per_step * r.group_size
        requests = [Request(p, prompt_key(it.prompt), s * n + i * r.group_size + j, r.max_tokens, self.eos)
                    for i, (it, p) in enumerate(zip(items, prompts)) for j in range(r.group_size)]
        if max(len(p) for p in prompts) > self._longest:  # a longer prompt than sized for: a bigger cache
            from rlsched.executor.drafters import drafter_cache_len

            self._longest = max(len(p) for p in prompts)
            if hasattr(self.engine, "resize"):  # rlsched's engine or pool (vLLM's refuses what exceeds it)
                self.engine.resize(r.max_batch * (self._longest + r.max_tokens),
                                   drafter_cache_len(self._longest, r.max_tokens, r.k_max))
        self.generator.manual_seed(_seed(c.seed, "rollout", s))
        self.engine.rl_step = s
        t = time.perf_counter()
        result = self.engine.run(requests)
        generation_s = time.perf_counter() - t

        # inference: rewards, reference, critic
        t = time.perf_counter()
        texts = [self._decode(x.tokens) for x in result.samples]
        group = [q.sample_id // r.group_size % r.prompts_per_step for q in requests]
        inputs = [RewardInput(items[g].prompt, txt, items[g].answer, q.prompt_id, q.sample_id)
                  for q, g, txt in zip(requests, group, texts)]
        rb = self.reward_fn.score(inputs)
        failed = int(rb.failed.sum())
        inference_s = reward_s = time.perf_counter() - t
        self._write_rollout(s, items, requests, group, result, texts, rb)  # bookkeeping: no stage's time
        t = time.perf_counter()
        if failed > c.max_reward_failures * n:  # run()'s finally closes the trace writers
            raise RewardFailures(
                f"reward '{c.reward}' failed on {failed} of {n} samples at step {s} (more than "
                f"max_reward_failures={c.max_reward_failures:g}); first: {rb.errors[0]}; the run stopped, its traces "
                f"and last checkpoint are in {self.out}: fix the reward and run again with --resume")
        if failed:
            self.log(f"step {s}: reward failed on {failed} of {n} samples (left out of the update); "
                     f"first: {rb.errors[0]}")
        update = self._prepare_update(requests, group, result, rb)
        inference_s += time.perf_counter() - t

        t = time.perf_counter()
        train_stats = self._train(update, s)
        training_s = time.perf_counter() - t

        from rlsched.executor.rl.distill import ReplaySample

        self.buffer.add([ReplaySample(list(q.prompt) + x.tokens, len(q.prompt), float(rw))
                         for q, x, rw in zip(requests, result.samples, rb.rewards)])
        st = result.stats
        self.schedule.observe(generation_s, st.get("drafted", 0), st.get("accepted", 0), st.get("rejected"),
                              st.get("sd_rows", 0))
        t = time.perf_counter()
        distill_stats = self._update_drafter(s)
        if distill_stats is not None:
            self.schedule.updated(time.perf_counter() - t)  # the distillation's own cost
        self.engine.sync_weights(self.actor, self.drafter_model)  # the next rollout samples the new policy
        drafter_update_s = time.perf_counter() - t

        record = self._record(s, result, rb, requests, generation_s, inference_s, training_s,
                              drafter_update_s, time.perf_counter() - t_start, train_stats, distill_stats)
        record.update(reward_s=reward_s, reference_s=update["reference_s"], critic_s=update["critic_s"])
        self._rl_writer.append(record)
        if (s + 1) % c.checkpoint_every == 0 or s + 1 == c.steps:
            self._checkpoint(s + 1)
        return record

    def _prepare_update(self, requests, group, result, rb) -> dict:
        """The padded batch, old log-probs, advantages (and the critic's values for PPO)."""
        from rlsched.executor.rl.algos import gae, grpo_advantages, make_batch, terminal_rewards, token_logprobs

        c, a = self.cfg, self.cfg.algorithm
        valid = ~rb.failed
        batch = make_batch([q.prompt for q in requests], [x.tokens for x in result.samples],
                           [x.logprobs for x in result.samples], self.pad_id, valid.tolist())
        rewards = torch.as_tensor(np.nan_to_num(rb.rewards, nan=0.0), dtype=torch.float32)
        update = dict(batch=batch, ref_logp=None, old_values=None, returns=None, reference_s=0.0, critic_s=0.0)
        with torch.no_grad():
            if self.reference is not None:
                t = time.perf_counter()
                update["ref_logp"] = token_logprobs(self.reference, batch.ids, c.rollout.temperature)
                update["reference_s"] = time.perf_counter() - t
            if a.name == "grpo":
                adv = grpo_advantages(rewards, torch.as_tensor(group), torch.as_tensor(valid), a.normalise_std)
                update["advantages"] = adv[:, None].expand_as(batch.mask).clone() * batch.mask
            else:
                t = time.perf_counter()
                values = self.critic(batch.ids)
                update["critic_s"] = time.perf_counter() - t
                adv, returns = gae(terminal_rewards(rewards, batch), values, batch.mask, a.gamma, a.lam)
                m = batch.mask
                if m.any():  # whitened over the batch, as PPO implementations do
                    mean, std = adv[m].mean(), adv[m].std(unbiased=False)
                    adv = (adv - mean) / (std + 1e-6) * m
                update.update(advantages=adv, old_values=values, returns=returns)
        return update

    def _train(self, u: dict, s: int) -> dict:
        from rlsched.executor.rl.algos import policy_loss, token_logprobs, value_loss

        c, a = self.cfg, self.cfg.algorithm
        batch = u["batch"]
        n = len(batch)
        gen = torch.Generator().manual_seed(_seed(c.seed, "train", s))
        stats: dict[str, list] = {}
        self.actor.train().requires_grad_(True)
        if self.critic is not None:
            self.critic.train().requires_grad_(True)
        try:
            for _ in range(a.epochs):
                order = torch.randperm(n, generator=gen)
                for rows in order.chunk(a.minibatches):
                    mb = batch.select(rows)
                    logp = token_logprobs(self.actor, mb.ids, c.rollout.temperature)
                    ref = None if u["ref_logp"] is None else u["ref_logp"][rows]
                    loss, st = policy_loss(logp, mb.old_logp, u["advantages"][rows], mb.mask, a.clip_eps,
                                           a.loss_agg, ref, a.kl_coef)
                    self.actor_opt.zero_grad(set_to_none=True)
                    loss.backward()
                    st["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.actor.parameters(), a.max_grad_norm).item()
                    self.actor_opt.step()
                    st["loss"] = loss.item()
                    if self.critic is not None:
                        v = self.critic(mb.ids)
                        vl = value_loss(v, u["old_values"][rows], u["returns"][rows], mb.mask, a.value_clip,
                                        a.loss_agg)
                        self.critic_opt.zero_grad(set_to_none=True)
                        vl.backward()
                        torch.nn.utils.clip_grad_norm_(self.critic.parameters(), a.max_grad_norm)
                        self.critic_opt.step()
                        st["value_loss"] = vl.item()
                    for k, v in st.items():
                        stats.setdefault(k, []).append(v)
        finally:
            self.actor.eval().requires_grad_(False)
            if self.critic is not None:
                self.critic.eval().requires_grad_(False)
        return {k: float(np.mean(v)) for k, v in stats.items()}

    def _update_drafter(self, s: int) -> dict | None:
        from rlsched.executor.rl.distill import distill

        d = self.cfg.drafter_update
        if self.drafter_model is None or not self.schedule.due(s):
            return None
        gen = torch.Generator().manual_seed(_seed(self.cfg.seed, "distill", s))
        return distill(self.actor, self.drafter_model, self.drafter_opt, self.buffer, steps=d.steps, batch=d.batch,
                       weighting=d.weighting, weight_min=d.weight_min, weight_max=d.weight_max,
                       temperature=self.cfg.rollout.temperature, generator=gen, pad_id=self.pad_id)

    # --- records ------------------------------------------------------------------------------

    def _record(self, s, result, rb, requests, generation_s, inference_s, training_s, drafter_update_s,
                total_s, train_stats, distill_stats) -> dict:
        st = result.stats
        ok = ~rb.failed
        rewards = rb.rewards[ok]
        rec = dict(rl_step=s, generation_s=generation_s, inference_s=inference_s, training_s=training_s,
                   drafter_update_s=drafter_update_s, total_s=total_s,
                   prompt_tokens=sum(len(q.prompt) for q in requests),
                   response_tokens=int(st["tokens"]),
                   reward_mean=float(rewards.mean()) if len(rewards) else float("nan"),
                   reward_std=float(rewards.std()) if len(rewards) else float("nan"),
                   reward_failures=int(rb.failed.sum()), samples=len(result.samples),
                   response_len_mean=st["tokens"] / max(1, st["samples"]), tokens_per_s=st["tokens_per_s"],
                   engine_steps=st["steps"], drafted=st["drafted"], accepted=st["accepted"],
                   mean_accept_len=st["mean_accept_len"],
                   accept_rate=st["accepted"] / st["drafted"] if st["drafted"] else float("nan"),
                   drafter_kl_before=float("nan") if distill_stats is None else distill_stats["kl_before"],
                   drafter_kl_after=float("nan") if distill_stats is None else distill_stats["kl_after"])
        for k in ("migrated", "migrated_kv", "migrated_reprefill", "requeued", "instances_died"):
            if k in st:  # a pool of instances
                rec[k] = int(st[k])
        estimator = getattr(self.engine, "estimator", None)
        for name in self.drafter_names:
            rec[f"accept_mean_{name}"] = float(estimator.mean(name)) if estimator is not None else float("nan")
        for k in ("loss", "kl_ref", "clip_frac", "approx_kl_old", "grad_norm", "value_loss"):
            rec[k] = train_stats.get(k, float("nan"))
        return rec

    def _write_rollout(self, s, items, requests, group, result, texts, rb) -> None:
        from rlsched.traces.writer import write_table

        df = pd.DataFrame(dict(
            rl_step=s, prompt_id=[q.prompt_id for q in requests], sample_id=[q.sample_id for q in requests],
            prompt=[items[g].prompt for g in group], response=texts,
            response_len=[len(x.tokens) for x in result.samples], reward=rb.rewards, reward_failed=rb.failed,
            mean_accept_len=[x.mean_accept_len for x in result.samples]))
        write_table(self.out / "rollouts" / f"step-{s:06d}.parquet", pa.Table.from_pandas(df, preserve_index=False))

    # --- the run -------------------------------------------------------------------------------

    def run(self, on_step=None) -> dict:
        """Steps start_step..steps-1; then summary.json and the plots. Returns the summary."""
        with self:
            for s in range(self.start_step, self.cfg.steps):
                rec = self.step(s)
                if on_step is not None:
                    on_step(rec)
        return self.finish()

    def __enter__(self) -> "Trainer":
        """Open the RL-step trace, for `step` calls made by the caller: runs stepped in lockstep
        (`bench/fidelity.py`: an SD run and an off run alternating steps, so that this shared
        machine's slow spells hit both). `run` does it all."""
        from rlsched.executor.gcfreeze import freeze_long_lived
        from rlsched.traces.writer import TraceWriter

        self._rl_writer = TraceWriter(self.out / "traces", "rl_steps", flush_every=64, journal=True)
        freeze_long_lived()
        return self

    def __exit__(self, *exc) -> None:
        self._rl_writer.close()
        self.engine.close()

    def finish(self) -> dict:
        """summary.json and the plots, from the RL-step trace. Returns the summary."""
        from rlsched.traces.reader import read_trace
        from rlsched.traces.writer import write_text_atomic

        df = read_trace(self.out / "traces", "rl_steps").sort_values("rl_step")
        head, tail = df.head(max(1, len(df) // 5)), df.tail(max(1, len(df) // 5))
        summary = dict(
            steps=int(len(df)), reward_start=float(head["reward_mean"].mean()),
            reward_end=float(tail["reward_mean"].mean()),
            accept_len_start=float(head["mean_accept_len"].mean()), accept_len_end=float(tail["mean_accept_len"].mean()),
            seconds=float(df["total_s"].sum()),
            stage_s={k: float(df[f"{k}_s"].sum()) for k in ("generation", "inference", "training", "drafter_update")},
            tokens_per_s=float(df["response_tokens"].sum() / df["generation_s"].sum()),
            policy=self.cfg.policy, drafter=self.drafter_name, algorithm=self.cfg.algorithm.name,
            seed=self.cfg.seed, machine=platform.node(), threads=torch.get_num_threads(),
            created_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), out=str(self.out),
            traces=str(self.out / "traces"))
        try:
            from rlsched.analysis.plots import plot_run

            summary["plots"] = [str(p) for p in plot_run(df, self.out)]
        except ImportError:  # pragma: no cover - matplotlib is a core dependency
            summary["plots"] = []
        summary = _finite(summary)
        write_text_atomic(self.out / SUMMARY, json.dumps(summary, indent=2) + "\n")
        return summary


def _finite(x):
    """JSON has no NaN: None instead (a run without speculation has no acceptance rate)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _truncate_traces(root: Path, next_step: int) -> None:
    """Keep only the records of steps before `next_step` (those the checkpoint covers): one
    part per kind, swapped in as a whole folder (a crash mid-way is repaired on the next call)."""
    from rlsched.traces.reader import read_trace
    from rlsched.traces.writer import to_table, write_table

    if not root.is_dir():
        return
    for kind in ("steps", "samples", "rl_steps"):
        folder, new, old = root / kind, root / f".{kind}.new", root / f".{kind}.old"
        if not folder.exists() and new.exists():  # a crash between the two renames below
            new.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(new, ignore_errors=True)
        if not folder.is_dir():
            continue
        df = read_trace(folder, kind) if any(folder.iterdir()) else pd.DataFrame()
        keep = df[df["rl_step"] < next_step] if len(df) else df
        new.mkdir()
        if len(keep):
            write_table(new / "part-000000.parquet", to_table(kind, keep.reset_index(drop=True)))
        folder.rename(old)
        new.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
