"""The RL loop of `rlsched run`: speculative rollouts, rewards, the update, a fresh drafter.

One RL step (the stages the simulator models, each timed):

1. generation: the step's prompts x group_size samples through the rollout backend (adaptive
   speculative decoding; the backend's log-probs are the old policy's);
2. inference: rewards, the reference model's log-probs (KL penalty), the critic's values (PPO);
3. training: GRPO or PPO-clip update(s) of the actor (and the critic);
4. drafter update: the model drafter is distilled from the actor on the replay buffer every
   I steps, or (schedule `pays`) once its staleness has cost the generation stage what an
   update costs; the n-gram drafter indexes the newest rollouts of each prompt by itself.

Every step appends one `rl_steps` record (stage times, tokens, acceptance, rewards) to
`traces/`, next to the backend's step and sample records, and writes its samples to
`rollouts/step-NNNNNN.parquet`. Every `checkpoint_every` steps the whole state goes to
`checkpoint.pt` atomically (`checkpoint.py`). Randomness is a pure function of (seed, step),
so resuming from a checkpoint gives the numbers an uninterrupted run gives (except where
choices read wall-clock times: `bandit`, a calibrating `goodput`, the `pays` schedule of
drafter updates). Everything the loop runs on is built by `build.py`, which locks the out
folder for the rest of the process.

A write that fails for want of room or permission (a full disk, a file-size limit, a read-only
folder) ends the run in one line naming the file: to free space and continue with --resume
when a checkpoint was written (or the run was resumed), else the run's folder is removed.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from rlsched.errors import UserError
from rlsched.executor.decode.drafters import drafter_cache_len
from rlsched.executor.folders import WriteFailed, writing
from rlsched.executor.prompts import encode
from rlsched.executor.rl.build import build, write_failed
from rlsched.executor.rl.checkpoint import CHECKPOINT, save_checkpoint
from rlsched.executor.rl.config import RunConfig
from rlsched.executor.rl.data import prompt_key
from rlsched.executor.rl.records import step_record, write_rollout, write_summary
from rlsched.executor.seeds import derive_seed as _seed
from rlsched.policies.drafters import drafter_names


class RewardFailures(UserError):
    """Too many samples of a step had no reward: the run stops (its checkpoint stays)."""


class Trainer:
    """An RL run from a RunConfig (`build` checks every input before writing), then `run()`."""

    def __init__(self, cfg: RunConfig, out: Path, *, resume: bool = False, log=None):
        self.cfg, self.out, self.log = cfg, Path(out), log or (lambda msg: None)
        b = build(cfg, self.out, resume=resume, log=self.log)
        self.source, self.reward_fn, self.tokenizer, self.eos, self.pad_id = (
            b.source,
            b.reward_fn,
            b.tokenizer,
            b.eos,
            b.pad_id,
        )
        self.drafter_name, self.model_dir = b.drafter_name, b.model_dir
        self.drafter_names = drafter_names(b.drafter_name)
        self.state, self.reference, self.backend = b.state, b.reference, b.backend
        self.start_step, self._longest = b.start_step, b.longest
        self._resumed, self._out_existed = resume, b.out_existed

    # --- one RL step -------------------------------------------------------------------------

    def _requests(self, s: int, items) -> list:
        """Step `s`'s requests: each prompt `group_size` times (the caches grown first when a
        prompt is longer than they were sized for)."""
        from rlsched.executor.engine.rows import Request

        r = self.cfg.rollout
        prompts = [encode(self.tokenizer, i.prompt) for i in items]
        n = r.prompts_per_step * r.group_size
        requests = [
            Request(p, prompt_key(it.prompt), s * n + i * r.group_size + j, r.max_tokens, self.eos)
            for i, (it, p) in enumerate(zip(items, prompts))
            for j in range(r.group_size)
        ]
        if max(len(p) for p in prompts) > self._longest:  # a longer prompt than sized for: bigger caches
            self._longest = max(len(p) for p in prompts)
            self.backend.resize(
                r.max_batch * (self._longest + r.max_tokens), drafter_cache_len(self._longest, r.max_tokens, r.k_max)
            )
        return requests

    def step(self, s: int) -> dict:
        from rlsched.executor.rl.rewards import RewardInput

        c, r = self.cfg, self.cfg.rollout
        t_start = time.perf_counter()
        items = self.source.batch(s, r.prompts_per_step)
        requests = self._requests(s, items)
        n = r.prompts_per_step * r.group_size
        self.state.generator.manual_seed(_seed(c.seed, "rollout", s))
        self.backend.rl_step = s
        t = time.perf_counter()
        result = self.backend.run(requests)
        generation_s = time.perf_counter() - t

        # inference: rewards, reference, critic
        t = time.perf_counter()
        texts = [self._decode(x.tokens) for x in result.samples]
        group = [q.sample_id // r.group_size % r.prompts_per_step for q in requests]
        inputs = [
            RewardInput(items[g].prompt, txt, items[g].answer, q.prompt_id, q.sample_id)
            for q, g, txt in zip(requests, group, texts)
        ]
        rb = self.reward_fn.score(inputs)
        failed = int(rb.failed.sum())
        inference_s = reward_s = time.perf_counter() - t
        write_rollout(self.out, s, items, requests, group, result, texts, rb)  # bookkeeping: no stage's time
        t = time.perf_counter()
        if failed > c.max_reward_failures * n:  # run()'s finally closes the trace writers
            raise RewardFailures(
                f"reward '{c.reward}' failed on {failed} of {n} samples at step {s} (more than "
                f"max_reward_failures={c.max_reward_failures:g}); first: {rb.errors[0]}; the run stopped, its traces "
                f"and last checkpoint are in {self.out}: fix the reward and run again with --resume"
            )
        if failed:
            self.log(
                f"step {s}: reward failed on {failed} of {n} samples (left out of the update); first: {rb.errors[0]}"
            )
        update = self._prepare_update(requests, group, result, rb)
        inference_s += time.perf_counter() - t

        t = time.perf_counter()
        train_stats = self._train(update, s)
        training_s = time.perf_counter() - t

        from rlsched.executor.rl.distill import ReplaySample

        state, st = self.state, result.stats
        state.buffer.add(
            [
                ReplaySample(list(q.prompt) + x.tokens, len(q.prompt), float(rw))
                for q, x, rw in zip(requests, result.samples, rb.rewards)
            ]
        )
        state.schedule.observe(
            generation_s, st.get("drafted", 0), st.get("accepted", 0), st.get("rejected"), st.get("sd_rows", 0)
        )
        t = time.perf_counter()
        distill_stats = self._update_drafter(s)
        if distill_stats is not None:
            state.schedule.updated(time.perf_counter() - t)  # the distillation's own cost
        self.backend.sync_weights(state.actor, state.drafter_model)  # the next rollout samples the new policy
        drafter_update_s = time.perf_counter() - t

        times = dict(
            generation_s=generation_s,
            inference_s=inference_s,
            training_s=training_s,
            drafter_update_s=drafter_update_s,
            total_s=time.perf_counter() - t_start,
        )
        record = step_record(
            s, requests, result, rb, times, train_stats, distill_stats, self.backend.estimator, self.drafter_names
        )
        record.update(reward_s=reward_s, reference_s=update["reference_s"], critic_s=update["critic_s"])
        self._rl_writer.append(record)
        if (s + 1) % c.checkpoint_every == 0 or s + 1 == c.steps:
            self._checkpoint(s + 1)
        return record

    def _checkpoint(self, next_step: int) -> None:
        """The whole state to checkpoint.pt, atomically (a failed write: WriteFailed naming it)."""
        path = self.out / CHECKPOINT
        with writing(path):  # torch's writer turns a failed write's OSError into its own error
            save_checkpoint(path, self.state.state_dict(self.cfg.model_dump(), next_step, self.backend.policy_state()))

    def _prepare_update(self, requests, group, result, rb) -> dict:
        """The padded batch, old log-probs, advantages (and the critic's values for PPO)."""
        from rlsched.executor.rl.algos import gae, grpo_advantages, make_batch, terminal_rewards, token_logprobs

        c, a = self.cfg, self.cfg.algorithm
        valid = ~rb.failed
        batch = make_batch(
            [q.prompt for q in requests],
            [x.tokens for x in result.samples],
            [x.logprobs for x in result.samples],
            self.pad_id,
            valid.tolist(),
        )
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
                values = self.state.critic(batch.ids)
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

        c, a, state = self.cfg, self.cfg.algorithm, self.state
        batch = u["batch"]
        n = len(batch)
        gen = torch.Generator().manual_seed(_seed(c.seed, "train", s))
        stats: dict[str, list] = {}
        state.actor.train().requires_grad_(True)
        if state.critic is not None:
            state.critic.train().requires_grad_(True)
        try:
            for _ in range(a.epochs):
                order = torch.randperm(n, generator=gen)
                for rows in order.chunk(a.minibatches):
                    mb = batch.select(rows)
                    logp = token_logprobs(state.actor, mb.ids, c.rollout.temperature)
                    ref = None if u["ref_logp"] is None else u["ref_logp"][rows]
                    loss, st = policy_loss(
                        logp, mb.old_logp, u["advantages"][rows], mb.mask, a.clip_eps, a.loss_agg, ref, a.kl_coef
                    )
                    state.actor_opt.zero_grad(set_to_none=True)
                    loss.backward()
                    st["grad_norm"] = torch.nn.utils.clip_grad_norm_(state.actor.parameters(), a.max_grad_norm).item()
                    state.actor_opt.step()
                    st["loss"] = loss.item()
                    if state.critic is not None:
                        v = state.critic(mb.ids)
                        vl = value_loss(v, u["old_values"][rows], u["returns"][rows], mb.mask, a.value_clip, a.loss_agg)
                        state.critic_opt.zero_grad(set_to_none=True)
                        vl.backward()
                        torch.nn.utils.clip_grad_norm_(state.critic.parameters(), a.max_grad_norm)
                        state.critic_opt.step()
                        st["value_loss"] = vl.item()
                    for k, v in st.items():
                        stats.setdefault(k, []).append(v)
        finally:
            state.actor.eval().requires_grad_(False)
            if state.critic is not None:
                state.critic.eval().requires_grad_(False)
        return {k: float(np.mean(v)) for k, v in stats.items()}

    def _update_drafter(self, s: int) -> dict | None:
        from rlsched.executor.rl.distill import distill

        d, state = self.cfg.drafter_update, self.state
        if state.drafter_model is None or not state.schedule.due(s):
            return None
        gen = torch.Generator().manual_seed(_seed(self.cfg.seed, "distill", s))
        if self.drafter_name == "eagle":
            from rlsched.executor.decode.eagle_train import distill_head as train
        else:
            train = distill
        return train(
            state.actor,
            state.drafter_model,
            state.drafter_opt,
            state.buffer,
            steps=d.steps,
            batch=d.batch,
            weighting=d.weighting,
            weight_min=d.weight_min,
            weight_max=d.weight_max,
            temperature=self.cfg.rollout.temperature,
            generator=gen,
            pad_id=self.pad_id,
        )

    def _decode(self, ids: list[int]) -> str:
        n = self.tokenizer.get_vocab_size()
        return self.tokenizer.decode([i for i in ids if i < n], skip_special_tokens=True)

    # --- the run -------------------------------------------------------------------------------

    def run(self, on_step=None) -> dict:
        """Steps start_step..steps-1; then summary.json (the run command adds the plots). Returns
        the summary. A write failing for want of room or permission raises a one-line UserError."""
        try:
            with writing(self.out):
                with self:
                    for s in range(self.start_step, self.cfg.steps):
                        rec = self.step(s)
                        if on_step is not None:
                            on_step(rec)
                return self.finish()
        except WriteFailed as e:
            resumable = self._resumed or (self.out / CHECKPOINT).is_file()
            raise write_failed(e, self.out, resumable, self._out_existed) from None

    def __enter__(self) -> Trainer:
        """Open the RL-step trace, for `step` calls made by the caller: runs stepped in lockstep
        (`bench/fidelity.py`: an SD run and an off run alternating steps, so that this shared
        machine's slow spells hit both). `run` does it all."""
        from rlsched.executor.gcfreeze import freeze_long_lived
        from rlsched.traces.writer import TraceWriter

        self._rl_writer = TraceWriter(self.out / "traces", "rl_steps", flush_every=64, journal=True)
        freeze_long_lived()
        return self

    def __exit__(self, *exc) -> None:
        """Close the RL-step trace and the backend, both; when the steps failed, their error is
        the one raised (closing after a full disk fails too)."""
        first = None
        for close in (self._rl_writer.close, self.backend.close):
            try:
                close()
            except Exception as e:
                first = first or e
        if first is not None and exc[0] is None:
            raise first

    def finish(self) -> dict:
        """summary.json, from the RL-step trace. Returns the summary."""
        return write_summary(self.out, self.cfg, self.drafter_name, self.model_dir)
