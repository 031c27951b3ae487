"""Several rollout instances as Ray actors, with live sample reallocation and failover.

Each instance is one engine in its own Ray worker process (its own threads; its own device in
real use): rlsched's `RolloutEngine`, or a `VllmRolloutEngine` (`spec.backend = "vllm"`),
writing its traces as before (parts tagged by instance). The driver holds the rollout's
bookkeeping:

- it assigns the samples (a prompt's G samples to one instance, prompts round-robin), then
  lets every instance run a few engine steps at a time (`work`), each call answering with the
  samples that finished and the instance's view (running ids and contexts, queue, KV room);
- after every answer it runs the ReallocPolicy from `policies/` on the live views, exactly
  as the simulator does (events 'finished', 'drained' below the threshold, 'idle'), and
  carries the migrations out between the two instances' steps: a running sequence leaves with
  its tokens and log-probs and either its KV-cache rows (rlsched's engines on one host) or
  nothing, to be re-prefilled at the destination, whichever the cost model prices cheaper (a
  vLLM sample is aborted at its source and resubmitted with prompt + partial response);
- an instance that dies (its process gone: `ray.kill`, a crash, an out-of-memory kill) has
  every sample it held and had not yet reported re-queued on the others, from the prompt, and
  is started again (up to `max_restarts` times) with the current weights; once up it joins the
  rollout under way as an idle instance (the ReallocPolicy may hand it work).

A sample is reported by exactly one instance exactly once: the driver refuses a second
report, and checks at the end that every request came back.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace

import numpy as np

from rlsched.distributed import check_cluster_address, import_ray
from rlsched.errors import UserError
from rlsched.executor.engine.rows import Request, RolloutResult, check_requests, reserve
from rlsched.executor.pool.moves import Move, measure_host_cost, view_with, view_without
from rlsched.executor.pool.worker import MOVES, InstanceSpec, actor_class
from rlsched.executor.seeds import derive_seed as _seed
from rlsched.policies.types import InstanceView, Migration, ReallocEvent

STEPS_PER_CALL = 4  # engine steps per `work` call: how often the driver sees the instances
CALLS_QUEUED = 2  # `work` calls queued per instance: it does not wait for the driver between calls


def require_ray():
    """Ray, and the cluster RAY_ADDRESS names answering (checked before anything is loaded or
    written: ray.init would retry a dead address for minutes)."""
    ray = import_ray("more than one rollout instance (--instances)")
    check_cluster_address(os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS (more than one rollout instance)")
    return ray


class _Means:
    """The acceptance estimates the trainer records: the instances' mean per drafter."""

    def __init__(self):
        self.by_instance: dict[int, dict[str, float]] = {}

    def mean(self, drafter: str) -> float:
        vals = [m[drafter] for m in self.by_instance.values() if drafter in m]
        return float(np.mean(vals)) if vals else float("nan")


class InstancePool:
    """N rollout instances on Ray with a ReallocPolicy in the driver; a RolloutBackend
    (`executor/backends.py`) whose `run(requests)` returns what `RolloutEngine.run` returns,
    plus the migration and failover counts in the stats.

    spec: how each instance is built; realloc: a ReallocPolicy name; threshold: the load
    below which an instance reports 'drained'; cost: the base CostModel migrations are priced
    by (a MeasuredCostModel; needed for realloc other than 'none', except on vLLM, whose first
    instance measures its own); states: per-instance (policy, estimator, n-gram history) to
    restore from a checkpoint; max_restarts: how often one instance is started again after
    dying."""

    def __init__(
        self,
        n: int,
        spec: InstanceSpec,
        *,
        realloc: str = "none",
        threshold: int = 8,
        cost=None,
        seed: int = 0,
        target_state=None,
        drafter_state=None,
        states=None,
        max_restarts: int = 3,
        log=None,
    ):
        from rlsched.policies.realloc import make_realloc_policy

        if n < 1:
            raise UserError(f"instances must be >= 1 (got {n})")
        self.realloc = make_realloc_policy(realloc)
        if self.realloc.name != "none" and cost is None and spec.backend != "vllm":
            raise UserError(f"reallocation '{realloc}' needs a cost model (a profile of the instances' steps)")
        ray = require_ray()
        self.ray, self.n, self.spec, self.threshold, self.seed = ray, n, spec, threshold, seed
        self.log = log or (lambda msg: None)
        if not ray.is_initialized():
            # RAY_ADDRESS names a running cluster to join, which refuses a CPU count (its own
            # counts stand); without it, a private local Ray with this machine's cores
            size = {} if os.environ.get("RAY_ADDRESS") else {"num_cpus": max(2, os.cpu_count() or 1)}
            ray.init(
                **size, include_dashboard=False, configure_logging=False, log_to_driver=False, ignore_reinit_error=True
            )
        remote, spec = actor_class(ray, n, spec)
        self._remote, self._actor_spec = remote, spec
        self._weights = (
            None if target_state is None else ray.put(_cpu(target_state)),
            None if drafter_state is None else ray.put(_cpu(drafter_state)),
        )
        self.actors = [remote.remote(i, spec, *self._weights, states[i] if states else None) for i in range(n)]
        self.alive = set(range(n))
        self.max_restarts, self.restarts = max_restarts, [0] * n
        self.starting: dict = {}  # instance -> its `begin` call, while a restarted instance starts
        self._begin_args = (np.zeros(0, dtype=np.int64), 1)
        self._reset_rollout([], np.zeros(0, dtype=np.int64))
        # started (and the models loaded) before timing anything
        self.node_of = [node for _, node in ray.get([a.where.remote() for a in self.actors])]
        self.kv_moves = spec.backend == "local"  # vLLM's samples move as tokens and are re-prefilled
        if cost is None and self.realloc.name != "none":  # vLLM: step costs measured by the first instance
            cost = ray.get(self.actors[0].measured_cost.remote())
        self.cost = None if cost is None else measure_host_cost(self.ray, self.actors[0], self.spec, cost)
        self.rl_step = 0
        self.estimator = _Means()
        self.on_report = None  # test hook: called with (instance, report) after every answer

    # --- the rollout ------------------------------------------------------------------------

    def run(self, requests: list[Request]) -> RolloutResult:
        """Generate every request across the live instances, migrating and re-queueing as the
        module's docstring says; results in request order, with overall stats."""
        ray = self.ray
        check_requests(requests, self.spec.cache_capacity)
        n = len(requests)
        prompt_index: dict = {}
        prompt_of = np.array(
            [prompt_index.setdefault(r.prompt_id, len(prompt_index)) for r in requests], dtype=np.int64
        )
        longest = max((reserve(r) for r in requests), default=1)
        self._await_starting()
        live = sorted(self.alive)
        if not live:
            raise RuntimeError("every rollout instance has died")
        self._begin_args = (prompt_of, longest)
        self._reset_rollout(requests, np.array([live[p % len(live)] for p in prompt_of], dtype=np.int64))
        assigned = {i: np.flatnonzero(self.location == i) for i in live}  # before any failover moves some
        # every instance begins before any gets work (a failover may send it some)
        begun = {i: self._begin(i) for i in live}
        for i, ref in begun.items():
            if i in self.alive:
                self._call(i, ref, self._set_view)
        for i in live:
            if i in self.alive:
                self._call(i, self.actors[i].submit.remote([(j, requests[j]) for j in assigned[i]]), self._set_view)
        self._done = 0
        while self._done < n:
            for i in sorted(self.alive):  # two calls queued: the next starts as soon as one ends
                queue = self.inflight.setdefault(i, [])
                while len(queue) < CALLS_QUEUED and self.views[i].load > 0:
                    queue.append(self.actors[i].work.remote(STEPS_PER_CALL))
            oldest = {q[0]: k for k, q in self.inflight.items() if q}
            landing = {m.import_ref: m for m in self.moves}
            starting = {ref: k for k, ref in self.starting.items()}
            if not oldest and not landing and not starting:
                raise RuntimeError(f"rollout stalled with {n - self._done} samples unfinished")
            ready, _ = ray.wait([*oldest, *landing, *starting], num_returns=1)
            if ready[0] in landing:
                self._settle(landing[ready[0]])
                continue
            if ready[0] in starting:
                self._started(starting[ready[0]])
                continue
            i = oldest[ready[0]]
            report = self._collect(i)
            if report is not None and self.realloc.name != "none":
                self._reallocate(i, report)
        seconds = time.perf_counter() - self._t0
        for m in list(self.moves):  # moves of samples that finished first: landed empty before the next rollout
            self._settle(m)
        missing = [j for j, r in enumerate(self.results) if r is None]
        if missing:  # cannot happen: the loop ends when every sample has been reported
            raise RuntimeError(f"samples {missing[:5]} were never reported")
        return RolloutResult(list(self.results), self._summary(seconds))

    def _reset_rollout(self, requests: list[Request], location: np.ndarray) -> None:
        """The driver's bookkeeping of one rollout (empty before the first)."""
        self.requests, self.results, self.location = requests, [None] * len(requests), location
        self.views: dict[int, InstanceView] = {}
        self.totals: dict[int, dict] = {}
        self.counts = dict(
            migrated=0, migrated_kv=0, migrated_reprefill=0, migrations=0, requeued=0, instances_died=0, restarted=0
        )
        self.inflight: dict[int, list] = {}  # per instance, its queued `work` calls, oldest first
        self.view_seq: dict[int, int] = {}
        self.moves: list[Move] = []  # migrations under way (export, then import, queued on the instances)
        self._released: set[int] = set()  # idle instances the policy gives nothing more this rollout
        self._t0 = time.perf_counter()
        self.finish_s = {i: 0.0 for i in self.alive}

    def _call(self, i: int, ref, then=None):
        """ray.get one call to instance i; None (and its samples re-queued) if it died."""
        try:
            value = self.ray.get(ref)
        except self.ray.exceptions.RayActorError:
            self._died(i)
            return None
        if then is not None:
            then(i, value)
        return value

    def _set_view(self, i: int, view: dict) -> None:
        if view["seq"] <= self.view_seq.get(i, 0):  # an answer older than one already read
            return
        self.view_seq[i] = view["seq"]
        v = InstanceView(
            i,
            view["running_ids"],
            view["running_ctx"],
            None,
            list(view["waiting_ids"]),
            int(view["kv_free_tokens"]),
            int(view["max_batch"]),
        )
        for m in self.moves:  # as it will be once the moves under way have landed
            if m.src == i:
                v = view_without(v, set(m.ids), self.requests)
            elif m.dst == i:
                have = set(v.running_ids.tolist()) | set(v.waiting_ids)
                v = view_with(v, [j for j in m.ids if j not in have and self.results[j] is None], self.requests)
        self.views[i] = v

    def _collect(self, i: int) -> dict | None:
        """Instance i's answer to its `work` call: record its finished samples (each once)."""
        report = self._call(i, self.inflight[i].pop(0))
        if report is None:
            return None
        for j, res in report["finished"]:
            if self.location[j] != i:  # it arrived here by a move whose landing is not yet read
                for m in [m for m in self.moves if m.dst == i and j in m.ids]:
                    self._settle(m)
            if self.results[j] is not None:
                raise RuntimeError(f"sample {j} was reported twice (instance {i})")
            if self.location[j] != i:
                raise RuntimeError(f"sample {j} was reported by instance {i}, but it lives on {self.location[j]}")
            self.results[j] = res
            self._done += 1
        self._set_view(i, report["view"])
        self.totals[i] = report["totals"]
        self.estimator.by_instance[i] = report["accept_means"]
        if report["finished"]:
            self.finish_s[i] = time.perf_counter() - self._t0
        if self.on_report is not None:
            self.on_report(i, report)
        return report

    def _died(self, i: int) -> None:
        """Instance i is gone: every sample it held and never reported starts again elsewhere.
        It is killed first: an instance Ray only found unreachable must not come back and
        report (or export) what now runs elsewhere."""
        with contextlib.suppress(Exception):  # already gone
            self.ray.kill(self.actors[i], no_restart=True)
        self.alive.discard(i)
        self.inflight.pop(i, None)
        self.views.pop(i, None)
        self.view_seq.pop(i, None)  # a restarted instance numbers its views afresh
        self.counts["instances_died"] += 1
        for m in [m for m in self.moves if i in (m.src, m.dst)]:  # where each moving sample now is
            self._settle(m)
        lost = [j for j in np.flatnonzero(self.location == i) if self.results[j] is None]
        self._restart(i)
        if not self.alive:  # no other instance can take them: wait for this one to be back
            self._await_starting()
        live = sorted(self.alive)
        self.log(f"rollout instance {i} died; re-queuing its {len(lost)} unfinished samples on {len(live)} instance(s)")
        if not live:
            raise RuntimeError("every rollout instance has died; the rollout cannot complete")
        by_prompt: dict[int, list[int]] = {}
        for j in lost:
            by_prompt.setdefault(self.requests[j].prompt_id, []).append(int(j))
        for group in by_prompt.values():
            self._requeue(group)

    def _begin(self, i: int):
        """Queue instance i's `begin` of the rollout under way (its answer: the view)."""
        prompt_of, longest = self._begin_args
        return self.actors[i].begin.remote(
            self.rl_step, prompt_of, longest, _seed(self.seed, "instance", self.rl_step, i, self.restarts[i])
        )

    def _restart(self, i: int) -> None:
        """Start instance i again (the current weights, a fresh policy), without waiting: it
        joins once its `begin` answers (`_started`)."""
        if self.restarts[i] >= self.max_restarts:
            self.log(f"rollout instance {i} died {self.restarts[i] + 1} times; not restarting it")
            return
        self.restarts[i] += 1
        self.actors[i] = self._remote.remote(i, self._actor_spec, *self._weights, None)
        self.starting[i] = self._begin(i)
        self.log(f"restarting rollout instance {i}")

    def _started(self, i: int) -> None:
        """A restarted instance answered its `begin`: it is live, idle, in the rollout under way."""
        ref = self.starting.pop(i)
        try:
            view = self.ray.get(ref)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.RayTaskError) as e:
            self.log(f"rollout instance {i} failed to start again ({type(e).__name__})")
            self._restart(i)
            return
        self.alive.add(i)
        self.counts["restarted"] += 1
        self.finish_s.setdefault(i, 0.0)
        self._set_view(i, view)
        if self.realloc.name != "none" and self.requests:
            self._event(i, "idle")

    def _await_starting(self) -> None:
        """Wait for the instances being restarted (before a rollout or a weight update)."""
        while self.starting:
            self._started(next(iter(self.starting)))

    def _requeue(self, group: list[int]) -> None:
        """Send these samples (from the prompt) to the least loaded live instance."""
        live = sorted(self.alive)
        if not live:
            raise RuntimeError("every rollout instance has died; the rollout cannot complete")
        dst = min(live, key=lambda k: (self.views[k].load if k in self.views else 0, k))
        self.location[group] = dst  # if dst dies taking them, its own handler re-queues them
        if (
            self._call(dst, self.actors[dst].submit.remote([(j, self.requests[j]) for j in group]), self._set_view)
            is not None
        ):
            self.counts["requeued"] += len(group)

    # --- reallocation ------------------------------------------------------------------------

    def _reallocate(self, i: int, report: dict) -> None:
        """Instance i answered: its own event if sequences finished, then every idle instance
        is offered work again (the views it was offered before may have shown the others'
        samples still queued, not yet running), unless the policy released it: one that
        `releases_idle` frees an instance that its first idle event gave nothing."""
        if i in self.views and self.views[i].load > 0 and report["finished"]:
            self._event(i, "drained" if self.views[i].load < self.threshold else "finished")
        for k in sorted(self.alive):
            if k in self.views and self.views[k].load == 0 and k not in self._released:
                self._event(k, "idle")
                if getattr(self.realloc, "releases_idle", False) and self.views[k].load == 0:
                    self._released.add(k)

    def _event(self, i: int, kind: str) -> None:
        """Ask the ReallocPolicy what to move after instance i's event; start those moves."""
        views = [self.views[k] for k in sorted(self.alive) if k in self.views]
        event = ReallocEvent(kind, i, time.perf_counter() - self._t0, views)
        for m in self.realloc.on_event(event, self.cost):
            self._migrate(m)

    def _migrate(self, m: Migration) -> None:
        """Start moving m's samples: an export queued on the source (it runs between two of its
        steps) whose result an import queued on the destination takes (between two of its
        steps); neither instance waits for the driver. Running samples ship their KV rows or
        are re-prefilled, whichever the cost model prices cheaper."""
        from rlsched.policies.realloc import split_kv_reprefill

        src, dst = m.src, m.dst
        if src not in self.alive or dst not in self.alive:
            return
        busy = {j for mv in self.moves for j in mv.ids}
        ids = [int(j) for j in m.sample_ids if self.results[j] is None and self.location[j] == src and j not in busy]
        if not ids:
            return
        v = self.views[src]
        ctx_of = dict(zip(v.running_ids.tolist(), v.running_ctx.tolist()))
        running = sorted((j for j in ids if j in ctx_of), key=lambda j: ctx_of[j])
        with_kv: list[int] = []
        if running and m.mode != "reprefill" and self.kv_moves and self.node_of[src] == self.node_of[dst]:
            ctx = np.array([ctx_of[j] for j in running], dtype=np.int64)
            cut = 0 if m.mode == "kv" else split_kv_reprefill(self.cost, ctx)
            with_kv = running[cut:]
        export_ref = self.actors[src].export_rows.options(concurrency_group=MOVES).remote(ids, with_kv)
        import_ref = self.actors[dst].import_rows.options(concurrency_group=MOVES).remote(export_ref)
        self.moves.append(Move(src, dst, ids, export_ref, import_ref))
        # the policy's next look sees them where they are going (as the simulator shows them)
        self.views[src] = view_without(v, set(ids), self.requests)
        self.views[dst] = view_with(self.views[dst], ids, self.requests)

    def _settle(self, move: Move) -> None:
        """A migration's outcome: which samples left the source and whether they landed."""
        if move not in self.moves:
            return
        self.moves.remove(move)
        try:
            exported = self.ray.get(move.export_ref)
        except self.ray.exceptions.RayActorError:  # the source died first: they are still its own
            if move.src in self.alive:
                self._died(move.src)
            return
        self._set_view(move.src, exported["view"])
        moved = [mv["index"] for mv in exported["moved"]]
        if not moved:
            return
        self.location[moved] = move.dst
        try:
            landed = self.ray.get(move.import_ref)
        except self.ray.exceptions.RayActorError:  # the destination died: they start again elsewhere
            if move.dst in self.alive:
                self._died(move.dst)  # re-queues what it holds, these included
            else:
                self._requeue([j for j in moved if self.results[j] is None])
            return
        self._set_view(move.dst, landed["view"])
        self.counts["migrations"] += 1
        self.counts["migrated"] += len(moved)
        self.counts["migrated_kv"] += sum(mv["kv"] is not None for mv in exported["moved"])
        self.counts["migrated_reprefill"] += sum(1 for mv in exported["moved"] if mv["kv"] is None and mv["tokens"])

    # --- results and the rest ----------------------------------------------------------------

    def _summary(self, seconds: float) -> dict:
        t = {
            k: sum(tt.get(k, 0) for tt in self.totals.values())
            for k in ("steps", "drafted", "accepted", "rejected", "sd_emitted", "sd_rows")
        }
        tokens = sum(len(s.tokens) for s in self.results)
        return dict(
            samples=len(self.results),
            tokens=tokens,
            seconds=seconds,
            tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
            steps=t["steps"],
            drafted=t["drafted"],
            accepted=t["accepted"],
            rejected=t["rejected"],
            sd_rows=t["sd_rows"],
            mean_accept_len=t["sd_emitted"] / t["sd_rows"] if t["sd_rows"] else 1.0,
            kv_peak_tokens=max((tt.get("kv_peak_tokens", 0) for tt in self.totals.values()), default=0),
            max_running=max((tt.get("max_running", 0) for tt in self.totals.values()), default=0),
            instances=self.n,
            instances_alive=len(self.alive),
            instance_finish_s={str(k): v for k, v in sorted(self.finish_s.items())},
            **self.counts,
        )

    def kill(self, i: int) -> None:
        """End instance i's process now (what a crash does; tests and failure drills use it)."""
        self.ray.kill(self.actors[i], no_restart=True)

    def resize(self, cache_capacity: int, drafter_max_len: int) -> None:
        """Every instance makes room for longer requests (a longer prompt than sized for)."""
        self.spec = replace(self.spec, cache_capacity=cache_capacity, drafter_max_len=drafter_max_len)
        for i in sorted(self.alive):
            self._call(i, self.actors[i].resize.remote(cache_capacity, drafter_max_len))

    def sync_weights(self, model, drafter_model=None) -> None:
        """The trainer's new weights to every instance (one copy in the object store)."""
        self._await_starting()
        t_ref = self.ray.put(_cpu(model.state_dict()))
        d_ref = None if drafter_model is None else self.ray.put(_cpu(drafter_model.state_dict()))
        self._weights = (t_ref, d_ref)  # what an instance started again loads
        for i in sorted(self.alive):
            self._call(i, self.actors[i].sync_weights.remote(t_ref, d_ref))

    def policy_state(self) -> list:
        """Per instance its engine's `policy_state()` (None for a dead one), for checkpoints:
        given back as `states` when the pool is rebuilt."""
        self._await_starting()
        return [self._call(i, self.actors[i].policy_state.remote()) if i in self.alive else None for i in range(self.n)]

    def close(self) -> None:
        """Write the instances' last trace parts and end their processes."""
        self.max_restarts = 0
        self.starting.clear()
        for i in sorted(self.alive):
            self._call(i, self.actors[i].flush.remote())
        for a in self.actors:
            with contextlib.suppress(Exception):  # already gone
                self.ray.kill(a, no_restart=True)
        self.alive.clear()


def _cpu(state: dict) -> dict:
    return {k: v.detach().to("cpu") for k, v in state.items()}
