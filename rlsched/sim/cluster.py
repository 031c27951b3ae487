"""A generation stage on N data-parallel instances: assignment, completion, reallocation.

The ReallocPolicy is called on events: sequences finished on an instance ('finished', or
'drained' when its load - running plus queued - is below `realloc_threshold`), and an instance
went empty ('idle'). It sees every instance as it will be once the migrations already requested
have landed (moving sequences count on their destination, as queued). Its migrations are
handed to the source instance and carried out at that instance's next step boundary (never in
the middle of its step). Queued sequences move as tokens, free; running ones either ship their
KV cache (they travel for the transfer time) or are re-prefilled at the destination (a
prefill step there), chosen per sequence by the cost model when the mode is 'auto'.

A policy with `releases_idle = True` (none, consolidate) gives no work to an instance that
went empty with nothing on its way: it is freed for the rest of the stage (free for other work,
such as the drafter update) and `freed_gpu_s` counts its GPU-seconds until the stage ends.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import simpy

from rlsched.config import SimConfig
from rlsched.errors import UserError
from rlsched.policies.acceptance import AcceptanceEstimator
from rlsched.policies.realloc import split_kv_reprefill
from rlsched.policies.tree import TreeShape, reference_acceptance, tree_shape
from rlsched.policies.types import CostModel, InstanceView, Migration, ReallocEvent
from rlsched.sim.instance import Instance
from rlsched.sim.timeline import Timeline
from rlsched.sim.vllm_engine import VllmInstance, check_engine
from rlsched.sim.workload import Rollout

_EMPTY_I = np.zeros(0, dtype=np.int64)

AS = ("tree_top1", "tree_gain", "position_decay")  # a drafter's acceptance shape, kept per drafter in a stage


def kv_capacity(cfg: SimConfig, cost) -> int:
    if cfg.cluster.kv_capacity_tokens is not None:
        return cfg.cluster.kv_capacity_tokens
    return cost.kv_capacity_tokens(cfg.cluster.gpu_memory_utilization, cfg.cluster.activation_reserve_gib)


class GenerationStage:
    """Every sample of one rollout, from prompt to last token, across the instances."""

    def __init__(
        self,
        env: simpy.Environment,
        cfg: SimConfig,
        cost: CostModel,
        rollout: Rollout,
        policies: list,
        realloc,
        estimator: AcceptanceEstimator,
        timeline: Timeline,
        rl_step: int,
        seed_seq: np.random.SeedSequence,
        capacity: int,
    ):
        self.env, self.cost, self.rollout, self.estimator, self.timeline = env, cost, rollout, estimator, timeline
        self.rl_step, self.t0 = rl_step, env.now
        n = rollout.n
        self.ctx_g = rollout.prompt_len.astype(np.int64).copy()
        self.tot_g = self.ctx_g + rollout.response_len.astype(np.int64)
        self.prefill_g = self.ctx_g.copy()
        self.seen_g = np.zeros((n, len(rollout.drafters)), dtype=np.int64)  # what each drafter has taken in
        with np.errstate(divide="ignore"):
            self.ninv = -1.0 / np.log(np.clip(rollout.acceptance, 0.0, 1.0 - 1e-12))
        self.drafter_idx = {name: j for j, name in enumerate(rollout.drafters)}
        # tree shapes are built for each drafter's configured acceptance, as policies build them
        specs = [cfg.drafter(name) for name in rollout.drafters]
        self.tree_ref = [reference_acceptance(d.acceptance.mean, d.acceptance.tree_top1) for d in specs]
        self.tree_top1, self.tree_gain, self.position_decay = ([getattr(d.acceptance, f) for d in specs] for f in AS)
        self.t_finish = np.full(n, np.nan)
        self.instance_of = np.full(n, -1, dtype=np.int32)
        self.preemptions = np.zeros(n, dtype=np.int32)
        self.migrations = np.zeros(n, dtype=np.int32)
        # (time, src, dst, n_seqs, ctx_tokens, mode, seconds): seconds of KV transfer, or the
        # re-prefill's time (charged as a prefill step at the destination), or 0 (queued: tokens)
        self.migration_log: list[tuple] = []
        self.max_batch = cfg.cluster.max_batch
        self.max_run = cfg.max_steady_run
        self.probe_every = cfg.speculation.probe_every
        self.kv_capacity = capacity
        self.kv_watermark = capacity // 100
        self.tp = cfg.cluster.tp
        longest = int(self.tot_g.max()) if n else 0
        if longest > capacity - self.kv_watermark:
            raise UserError(
                f"cluster.kv_capacity_tokens: an instance holds {capacity} KV tokens but a sequence "
                f"needs {longest}; lower workload.*_len.max or raise the capacity (more memory or tp)"
            )
        # engine.kind vllm: vLLM's settings, the drafters that draft on the host, the draft
        # slots vLLM reserves a running request
        self.engine = None
        if cfg.engine.kind == "vllm":
            hw = cfg.hardware
            self.host_drafters = {d.name for d in cfg.drafters if d.kind == "ngram"}
            self.engine = cfg.engine.resolve(hw.memory_gib, hw.name, cfg.cluster.max_batch, bool(self.host_drafters))
            self.lookahead = cfg.speculation.k_max if cfg.drafters else 0
            check_engine(self, longest)
        self.realloc = realloc
        self.realloc_threshold = cfg.cluster.realloc_threshold
        self.share_prompts = cfg.cluster.share_prompts
        self.realloc_active = realloc.name != "none" and len(policies) > 1
        self.releases_idle = bool(getattr(realloc, "releases_idle", False))
        self.freed_at = np.full(len(policies), np.nan)  # seconds into the stage when each instance was freed
        self.makespan = 0.0
        # drafted, accepted, rejected (chains cut short), row-steps drafting: what the `pays`
        # drafter-update schedule reads; not counted (None) for the fixed interval
        self.chains = np.zeros(4, dtype=np.int64) if cfg.rl.drafter_update_schedule == "pays" else None
        self.done = env.event()
        self.n_done = 0
        self._in_motion: set[int] = set()  # requested to move, not yet arrived
        self._incoming: list[dict[int, int]] = [{} for _ in policies]  # per destination: sample id -> context
        estimator.begin_rollout(n, rollout.prompt_of)
        rngs = [np.random.default_rng(s) for s in seed_seq.spawn(len(policies))]
        kind = Instance if self.engine is None else VllmInstance
        self.instances = [kind(i, self, p, r) for i, (p, r) in enumerate(zip(policies, rngs))]
        owner = (np.arange(n) if cfg.cluster.assignment == "round_robin" else rollout.prompt_of) % len(policies)
        for i, inst in enumerate(self.instances):
            inst.receive(np.flatnonzero(owner == i).tolist())
        if n == 0:
            self.done.succeed()

    def run(self):
        """SimPy process: the stage ends when every instance has drained and stopped."""
        yield self.env.all_of([self.env.process(inst.run()) for inst in self.instances])
        self.makespan = self.env.now - self.t0

    @property
    def freed_gpu_s(self) -> float:
        """GPU-seconds of instances freed before the stage ended: sum of (end - freed) x tp."""
        freed = self.freed_at[~np.isnan(self.freed_at)]
        return float(np.clip(self.makespan - freed, 0.0, None).sum() * self.tp)

    def tree(self, d: int, strategy) -> TreeShape:
        """The shape of a tree strategy of drafter d."""
        return tree_shape(strategy.k, strategy.width, strategy.nodes, self.tree_ref[d], self.tree_gain[d])

    # ------------------------------------------------------------------ events from instances
    def finished(self, inst: Instance, ids: np.ndarray) -> None:
        self.t_finish[ids] = self.env.now - self.t0
        self.instance_of[ids] = inst.idx
        self.estimator.finish(ids)
        self.n_done += len(ids)
        if self.n_done == self.rollout.n:
            self.done.succeed()
        elif self.realloc_active and inst.batch:  # an empty instance reports 'idle' at its next boundary
            load = inst.batch + len(inst.waiting)
            self.report(inst, "drained" if load < self.realloc_threshold else "finished")

    def views(self) -> list[InstanceView]:
        """Every instance still in the stage, as it will be once requested migrations land."""
        out = []
        for i in self.instances:
            if not np.isnan(self.freed_at[i.idx]):
                continue
            sid, ctx = i.sid, i.ctx
            kv_free = self.kv_capacity - i.ctx_sum
            if i.outbox:  # leaving: neither running nor queued here any more
                gone = {s for m in i.outbox for s in m.sample_ids}
                leaving = np.isin(sid, np.fromiter(gone, dtype=np.int64, count=len(gone)))
                if leaving.any():
                    kv_free += int(ctx[leaving].sum())
                    sid, ctx = sid[~leaving], ctx[~leaving]
                waiting = [s for s in i.waiting if s not in gone]
            else:
                waiting = list(i.waiting)
            incoming = self._incoming[i.idx]
            if incoming:  # arriving: queued here, ahead of the local queue
                waiting = list(incoming) + waiting
                kv_free -= sum(incoming.values())
            out.append(InstanceView(i.idx, sid, ctx, None, waiting, kv_free, self.max_batch))
        return out

    def report(self, inst: Instance, kind: str) -> None:
        """Sequences finished on an instance, or it went empty: ask the ReallocPolicy what to
        move; free an instance that went empty for good (when the policy releases idle ones)."""
        if self.done.triggered:
            return
        if self.realloc_active:
            event = ReallocEvent(kind, inst.idx, self.env.now - self.t0, self.views())
            for m in self.realloc.on_event(event, self.cost):
                self._request(m)
        if (
            kind == "idle"
            and self.releases_idle
            and not inst.waiting
            and not inst.outbox
            and not self._incoming[inst.idx]
        ):
            self.freed_at[inst.idx] = self.env.now - self.t0

    def _request(self, m: Migration) -> None:
        n_inst = len(self.instances)
        if m.src == m.dst or not (0 <= m.src < n_inst and 0 <= m.dst < n_inst) or not np.isnan(self.freed_at[m.dst]):
            return
        src, incoming = self.instances[m.src], self._incoming[m.dst]
        on_src = set(src.waiting)
        on_src.update(src.sid.tolist())
        ids = tuple(s for s in dict.fromkeys(int(s) for s in m.sample_ids) if s in on_src and s not in self._in_motion)
        if not ids:
            return
        self._in_motion.update(ids)
        ctx_g = self.ctx_g
        pos = {s: j for j, s in enumerate(src.sid.tolist())}
        for s in ids:
            incoming[s] = int(src.ctx[pos[s]]) if s in pos else int(ctx_g[s])
        src.outbox.append(Migration(m.src, m.dst, ids, m.mode))

    # ------------------------------------------------------------------ migration
    def carry_out(self, src: Instance) -> None:
        """At `src`'s step boundary: detach the requested sequences and send them off."""
        for m in src.outbox:
            wanted = set(m.sample_ids)
            queued = [s for s in src.waiting if s in wanted]
            if queued:
                src.waiting = deque(s for s in src.waiting if s not in wanted)
            keep = ~np.isin(src.sid, np.fromiter(wanted, dtype=np.int64, count=len(wanted)))
            running = src.take_rows(keep) if not keep.all() else _EMPTY_I
            gone = wanted.difference(queued, running.tolist())  # finished before the boundary
            for s in gone:
                self._in_motion.discard(s)
                self._incoming[m.dst].pop(s, None)
            if queued:  # not started, or waiting to recompute: only tokens move
                self._send(src.idx, m.dst, np.asarray(queued, dtype=np.int64), "tokens", 0.0)
            if len(running):
                if m.mode == "kv":
                    n_re = 0
                elif m.mode == "reprefill":
                    n_re = len(running)
                else:
                    running = running[np.argsort(self.ctx_g[running], kind="stable")]
                    n_re = split_kv_reprefill(self.cost, self.ctx_g[running])
                re, kv = running[:n_re], running[n_re:]
                if len(re):
                    c = self.ctx_g[re]
                    self.prefill_g[re] = c
                    self.seen_g[re] = 0
                    self._send(
                        src.idx,
                        m.dst,
                        re,
                        "reprefill",
                        self.cost.prefill_time(int(c.sum()), int((c * c).sum())),
                        travel=False,
                    )
                if len(kv):
                    self._send(src.idx, m.dst, kv, "kv", self.cost.kv_transfer_time(int(self.ctx_g[kv].sum()), len(kv)))
        src.outbox.clear()

    def _send(self, src: int, dst: int, ids: np.ndarray, mode: str, seconds: float, travel: bool = True) -> None:
        self.migrations[ids] += 1
        self.migration_log.append(
            (self.env.now - self.t0, src, dst, len(ids), int(self.ctx_g[ids].sum()), mode, seconds)
        )
        if seconds <= 0 or not travel:
            self._arrive(dst, ids)
            return

        def transfer():
            yield self.env.timeout(seconds)
            self._arrive(dst, ids)

        self.env.process(transfer())

    def _arrive(self, dst: int, ids: np.ndarray) -> None:
        ids = ids.tolist()
        incoming = self._incoming[dst]
        for s in ids:
            incoming.pop(s, None)
        self._in_motion.difference_update(ids)
        self.instances[dst].receive(ids)
