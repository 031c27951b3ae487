"""The RL step around generation, as a SimPy process: generation, inference (the actor's
old log-probs, reference, reward and critic forwards), training, and an optional drafter
update, over M RL steps with acceptance drift. Inference and training run on all GPUs of the
cluster (colocated) or on GPUs of their own (`rl.train_gpus`, split)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from rlsched.config import SimConfig, eagle_head
from rlsched.policies.acceptance import AcceptanceEstimator
from rlsched.policies.drafter_schedule import DrafterSchedule
from rlsched.policies.position import accepted_drafts, stage_decay
from rlsched.sim.cluster import GenerationStage
from rlsched.sim.timeline import Timeline
from rlsched.sim.workload import AcceptanceDrift, sample_rollout

TRAIN_BYTES_PER_PARAM = 16  # bf16 weights and gradients, fp32 master weights and Adam's two moments


@dataclass
class StepRecord:
    rl_step: int
    generation_s: float
    inference_s: float
    training_s: float
    drafter_update_s: float  # exposed on the critical path (0 when fully overlapped)
    total_s: float
    prompt_tokens: int
    response_tokens: int
    accept_means: dict[str, float]
    stage: GenerationStage = field(repr=False)


class StageCosts:
    """FLOP-based costs of the non-generation stages on their GPUs: the whole cluster's, or
    `rl.train_gpus` of their own."""

    def __init__(self, cfg: SimConfig):
        hw, rl = cfg.hardware, cfg.rl
        gpus = rl.train_gpus or cfg.cluster.instances * cfg.cluster.tp
        self.infer_rate = gpus * hw.peak_tflops * 1e12 * rl.infer_efficiency
        self.train_rate = gpus * hw.peak_tflops * 1e12 * rl.train_efficiency
        p = cfg.model.params
        # forwards over every rollout token: the actor's old log-probs (verl's compute_log_prob),
        # the reference's log-probs, the critic's values and the reward model's scores
        self.infer_params = (
            (p if rl.recompute_old_logprobs else 0)
            + (p if rl.reference else 0)
            + (p if rl.critic else 0)
            + (rl.reward_model.params if rl.reward_model is not None else 0)
        )
        self.train_params = p + (p if rl.critic else 0)
        learned = [d for d in cfg.drafters if d.kind in ("model", "eagle")]
        self.drafter_params = sum(
            (
                d.model.params
                if d.kind == "model" and d.model is not None
                else eagle_head(cfg.model, d.draft_vocab).params
            )
            for d in learned
        )
        self.target_params = p
        self.distill_fraction = rl.distill_fraction
        # offloaded states out after training and back before the next (per GPU, each way)
        state_bytes = TRAIN_BYTES_PER_PARAM * self.train_params / gpus
        self.offload_s = (
            2 * state_bytes / (hw.host_link_gbs * 1e9) if rl.offload_states and rl.train_gpus is None else 0.0
        )

    def inference(self, tokens: int) -> float:
        return 2.0 * self.infer_params * tokens / self.infer_rate

    def training(self, tokens: int) -> float:
        """About 6 x params x tokens (forward and backward), plus moving offloaded states."""
        return 6.0 * self.train_params * tokens / self.train_rate + self.offload_s

    def drafter_update(self, tokens: int) -> float:
        """Distillation: actor forward for its logits plus drafter forward and backward."""
        if self.drafter_params == 0:
            return 0.0
        t = tokens * self.distill_fraction
        return (2.0 * self.target_params + 6.0 * self.drafter_params) * t / self.train_rate


class TrueAcceptance:
    """The oracle's window on the current rollout: each sample's true acceptance (calling it),
    each instance's rows' true tokens left, its queue, and what its drafters have not taken in."""

    def __init__(self):
        self.rollout: Any = None  # the Rollout, set before each rollout runs
        self.stage: Any = None  # its GenerationStage

    def __call__(self, drafter: str, ids: np.ndarray) -> np.ndarray:
        return self.rollout.acceptance[ids, self.rollout.drafters.index(drafter)]

    def lengths_left(self, instance: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens left of the instance's running rows, and its queued rows' ids and tokens left."""
        st = self.stage
        inst = st.instances[instance]
        queued = np.fromiter(inst.waiting, dtype=np.int64, count=len(inst.waiting))
        return (inst.tot - inst.ctx).astype(float), queued, (st.tot_g[queued] - st.ctx_g[queued]).astype(float)

    def accepted_ahead(self, instance: int, drafter: str) -> np.ndarray:
        """Drafts each running row would accept at the instance's next chain step (before the
        cap at its k), from the draws it will take."""
        st = self.stage
        inst, d = st.instances[instance], st.drafter_idx[drafter]
        return accepted_drafts(inst._exp_draws(inst.batch, peek=True), inst.ninv[:, d], stage_decay(st, d))

    def unseen(self, instance: int) -> np.ndarray:
        """Tokens of the running rows each drafter has not taken in (its catch-up before it drafts)."""
        inst = self.stage.instances[instance]
        out = (inst.ctx[:, None] - inst.seen).sum(axis=0).astype(float)
        if inst.current >= 0:
            out[inst.current] = 0.0
        return out


class DrafterUpdates:
    """The drafter's updates between RL steps: when they are due (`DrafterSchedule`) and the
    seconds they expose on the critical path. An overlapped update runs beside the next rollout
    and must land before the weights change."""

    def __init__(self, env: simpy.Environment, cfg: SimConfig, costs: StageCosts, drift: AcceptanceDrift):
        self.env, self.cfg, self.costs, self.drift = env, cfg, costs, drift
        self.schedule = DrafterSchedule(cfg.rl.drafter_update_schedule, cfg.rl.drafter_update_interval, cfg.rl.steps)
        self.pending: simpy.Event | None = None  # an overlapped drafter update still running

    def land(self):
        """Wait for the overlapped update still running, if any; returns the seconds waited."""
        if self.pending is None:
            return 0.0
        t0 = self.env.now
        yield self.pending
        waited = self.env.now - t0
        self.drift.drafter_updated()
        self.schedule.updated(waited)  # what it cost the critical path
        self.pending = None
        return waited

    def start(self, step: int, tokens: int):
        """After training: update the drafter when due, beside the next rollout or in line;
        returns the seconds exposed."""
        if not (self.costs.drafter_params and self.schedule.due(step)):
            return 0.0
        t_upd = self.costs.drafter_update(tokens)
        if self.cfg.rl.overlap_drafter_update and step + 1 < self.cfg.rl.steps:
            self.pending = self.env.timeout(t_upd)  # runs beside the next rollout; its drafter is used after
            return 0.0
        yield self.env.timeout(t_upd)
        self.drift.drafter_updated()
        self.schedule.updated(t_upd)
        return t_upd


def rl_run(
    env: simpy.Environment,
    cfg: SimConfig,
    cost,
    make_policies,
    realloc,
    timeline: Timeline,
    records: list[StepRecord],
    capacity: int,
    progress=None,
    truth: TrueAcceptance | None = None,
):
    """SimPy process of M RL steps; appends one StepRecord per step."""
    root = np.random.SeedSequence(cfg.seed)
    workload_seq, engine_seq = root.spawn(2)
    workload_rng = np.random.default_rng(workload_seq)
    drift = AcceptanceDrift(
        [d for d in cfg.drafters if d.kind != "ngram"],
        cfg.rl.acceptance_drift_per_step,
        cfg.rl.acceptance_floor,
        cfg.rl.drafter_recovery,
    )
    means = {d.name: d.acceptance.mean for d in cfg.drafters}
    estimator = AcceptanceEstimator(
        [d.name for d in cfg.drafters], prior_mean=float(np.mean(list(means.values()))) if means else 0.5
    )
    policies = make_policies()
    costs = StageCosts(cfg)
    updates = DrafterUpdates(env, cfg, costs, drift)
    for step in range(cfg.rl.steps):
        means.update(drift.means())
        rollout = sample_rollout(cfg.workload, cfg.drafters, means, workload_rng)
        if truth is not None:
            truth.rollout = rollout
        stage = GenerationStage(
            env, cfg, cost, rollout, policies, realloc, estimator, timeline, step, engine_seq.spawn(1)[0], capacity
        )
        if truth is not None:
            truth.stage = stage
        t_start = env.now
        yield env.process(stage.run())
        t_gen = env.now - t_start
        tokens = int(rollout.prompt_len.sum() + rollout.response_len.sum())
        t_inf = costs.inference(tokens)
        yield env.timeout(t_inf)
        if stage.chains is not None:
            updates.schedule.observe(t_gen, *(int(x) for x in stage.chains))
        exposed = yield from updates.land()
        t_train = costs.training(tokens)
        yield env.timeout(t_train)
        drift.step()
        exposed += yield from updates.start(step, tokens)
        records.append(
            StepRecord(
                step,
                t_gen,
                t_inf,
                t_train,
                exposed,
                env.now - t_start,
                int(rollout.prompt_len.sum()),
                int(rollout.response_len.sum()),
                dict(means),
                stage,
            )
        )
        if progress is not None:
            progress(step + 1)
