"""A generation stage on N data-parallel instances: assignment, completion, reallocation.

The ReallocPolicy is called on events (an instance drains below `realloc_threshold`, or goes
idle). Its migrations are handed to the source instance and carried out at that instance's
next step boundary (never in the middle of its step); the moved sequences travel for the
cheaper of a KV-cache transfer or a re-prefill on arrival, as the cost model says.
"""

from __future__ import annotations

import numpy as np
import simpy

from rlsched.config import SimConfig
from rlsched.errors import UserError
from rlsched.policies.acceptance import AcceptanceEstimator
from rlsched.policies.types import CostModel, InstanceView, Migration, ReallocEvent
from rlsched.sim.engine import Instance
from rlsched.sim.timeline import Timeline
from rlsched.sim.workload import Rollout


def kv_capacity(cfg: SimConfig, cost) -> int:
    if cfg.cluster.kv_capacity_tokens is not None:
        return cfg.cluster.kv_capacity_tokens
    return cost.kv_capacity_tokens(cfg.cluster.gpu_memory_utilization, cfg.cluster.activation_reserve_gib)


class GenerationStage:
    """Every sample of one rollout, from prompt to last token, across the instances."""

    def __init__(self, env: simpy.Environment, cfg: SimConfig, cost: CostModel, rollout: Rollout,
                 policies: list, realloc, estimator: AcceptanceEstimator, timeline: Timeline, rl_step: int,
                 seed_seq: np.random.SeedSequence, capacity: int):
        self.env, self.cost, self.rollout, self.estimator, self.timeline = env, cost, rollout, estimator, timeline
        self.rl_step, self.t0 = rl_step, env.now
        n = rollout.n
        self.ctx_g = rollout.prompt_len.astype(np.int64).copy()
        self.tot_g = self.ctx_g + rollout.response_len.astype(np.int64)
        self.prefill_g = self.ctx_g.copy()
        with np.errstate(divide="ignore"):
            self.ninv = -1.0 / np.log(np.clip(rollout.acceptance, 0.0, 1.0 - 1e-12))
        self.drafter_idx = {name: j for j, name in enumerate(rollout.drafters)}
        self.t_finish = np.full(n, np.nan)
        self.instance_of = np.full(n, -1, dtype=np.int32)
        self.preemptions = np.zeros(n, dtype=np.int32)
        self.migrations = np.zeros(n, dtype=np.int32)
        self.migration_log: list[tuple] = []  # (time, src, dst, n_seqs, ctx_tokens, mode, seconds)
        self.max_batch = cfg.cluster.max_batch
        self.max_run = cfg.max_steady_run
        self.kv_capacity = capacity
        self.kv_watermark = capacity // 100
        longest = int(self.tot_g.max()) if n else 0
        if longest > capacity - self.kv_watermark:
            raise UserError(f"cluster.kv_capacity_tokens: an instance holds {capacity} KV tokens but a sequence "
                            f"needs {longest}; lower workload.*_len.max or raise the capacity (more memory or tp)")
        self.realloc = realloc
        self.realloc_threshold = cfg.cluster.realloc_threshold
        self.realloc_active = realloc.name != "none" and len(policies) > 1
        self.done = env.event()
        self.n_done = 0
        self._in_motion: set[int] = set()
        estimator.begin_rollout(n, rollout.prompt_of)
        rngs = [np.random.default_rng(s) for s in seed_seq.spawn(len(policies))]
        self.instances = [Instance(i, self, p, r) for i, (p, r) in enumerate(zip(policies, rngs))]
        owner = (np.arange(n) if cfg.cluster.assignment == "round_robin" else rollout.prompt_of) % len(policies)
        for i, inst in enumerate(self.instances):
            inst.receive(np.flatnonzero(owner == i).tolist())
        if n == 0:
            self.done.succeed()

    def run(self):
        """SimPy process: the stage ends when every instance has drained and stopped."""
        yield self.env.all_of([self.env.process(inst.run()) for inst in self.instances])
        self.makespan = self.env.now - self.t0

    # ------------------------------------------------------------------ events from instances
    def finished(self, inst: Instance, ids: np.ndarray) -> None:
        self.t_finish[ids] = self.env.now - self.t0
        self.instance_of[ids] = inst.idx
        self.estimator.finish(ids)
        self.n_done += len(ids)
        if self.n_done == self.rollout.n:
            self.done.succeed()

    def views(self) -> list[InstanceView]:
        return [InstanceView(i.idx, i.sid, i.ctx, i.tot - i.ctx, [s for s in i.waiting if s not in self._in_motion],
                             self.kv_capacity - i.ctx_sum, self.max_batch) for i in self.instances]

    def report(self, inst: Instance, kind: str) -> None:
        """An instance drained or went idle: ask the ReallocPolicy what to move."""
        if not self.realloc_active or self.done.triggered:
            return
        event = ReallocEvent(kind, inst.idx, self.env.now - self.t0, self.views())
        for m in self.realloc.on_event(event, self.cost):
            ids = tuple(s for s in m.sample_ids if s not in self._in_motion)
            if not ids or m.src == m.dst:
                continue
            self._in_motion.update(ids)
            self.instances[m.src].outbox.append(Migration(m.src, m.dst, ids, m.mode))

    # ------------------------------------------------------------------ migration
    def carry_out(self, src: Instance) -> None:
        """At `src`'s step boundary: detach the requested sequences and send them off."""
        for m in src.outbox:
            wanted = set(m.sample_ids)
            queued = [s for s in src.waiting if s in wanted]
            if queued:
                src.waiting = type(src.waiting)(s for s in src.waiting if s not in wanted)
            keep = ~np.isin(src.sid, np.fromiter(wanted, dtype=np.int64, count=len(wanted)))
            running = src.take_rows(keep) if not keep.all() else np.zeros(0, dtype=np.int64)
            self._in_motion.difference_update(wanted)
            if queued:  # not started, or waiting to recompute: only tokens move
                self._send(src.idx, m.dst, np.asarray(queued, dtype=np.int64), "tokens", 0.0)
            if len(running):
                ctx = int(self.ctx_g[running].sum())
                t_kv = self.cost.kv_transfer_time(ctx, len(running))
                t_re = self.cost.prefill_time(ctx, int((self.ctx_g[running] ** 2).sum()))
                use_kv = m.mode == "kv" or (m.mode == "auto" and t_kv <= t_re)
                if not use_kv:
                    self.prefill_g[running] = self.ctx_g[running]
                self._send(src.idx, m.dst, running, "kv" if use_kv else "reprefill", t_kv if use_kv else 0.0)
        src.outbox.clear()

    def _send(self, src: int, dst: int, ids: np.ndarray, mode: str, seconds: float) -> None:
        self.migrations[ids] += 1
        self.migration_log.append((self.env.now - self.t0, src, dst, len(ids), int(self.ctx_g[ids].sum()), mode,
                                   seconds))
        if seconds <= 0:
            self.instances[dst].receive(ids.tolist())
            return

        def travel():
            yield self.env.timeout(seconds)
            self.instances[dst].receive(ids.tolist())

        self.env.process(travel())
