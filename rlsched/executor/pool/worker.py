"""One rollout instance as the body of a Ray actor: its engine (rlsched's `RolloutEngine`, or a
`VllmRolloutEngine` when `spec.backend = "vllm"`) in its own worker process, stepped a few
engine steps per call, with rows moved in and out between two steps."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from rlsched.errors import UserError
from rlsched.executor.engine.rows import Request
from rlsched.executor.gcfreeze import freeze_long_lived
from rlsched.executor.setup import history_size
from rlsched.policies.drafters import HOST_DRAFTERS
from rlsched.policies.probe import PROBE_EVERY

MOVES = "moves"  # the actors' concurrency group of migrations


@dataclass
class InstanceSpec:
    """How to build one instance: the models (folders, plus current weights when an RL run
    has trained them), the drafter, sampling, the policy (each instance gets its own copy:
    acceptance estimates and bandits are per instance) and the engine's sizes."""

    target_dir: str
    drafter: str  # off, ngram, suffix, eagle or model
    drafter_dir: str | None
    sampling: object
    policy: object  # a DraftPolicy or a name
    cache_capacity: int
    max_batch: int
    k_max: int
    drafter_max_len: int
    trace_dir: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 1
    ngram_max_history: int | None = None
    share_prompts: bool = True
    probe_every: int | None = PROBE_EVERY
    backend: str = "local"  # local: rlsched's RolloutEngine; vllm: VllmRolloutEngine (the fields below)
    max_len: int = 0  # vLLM: the longest prompt + max_tokens + k_max + 1 it is sized for
    seed: int = 0
    typical_ctx: int | None = None
    cost: object = None  # vLLM: the cost model a priced policy runs on (None: measured at start-up)
    tp: int = 1  # vLLM: tensor_parallel_size
    gpu_memory_utilization: float = 0.9  # vLLM on a GPU


class InstanceWorker:
    """One rollout instance (the body of a Ray actor)."""

    def __init__(self, idx: int, spec: InstanceSpec, target_state=None, drafter_state=None, state=None):
        """state: (policy, estimator, n-gram history) restored from a checkpoint, or None."""
        torch.set_num_threads(spec.threads)
        self.idx, self.spec = idx, spec
        self.generator = None
        if spec.backend == "vllm":
            self._start_vllm(target_state, drafter_state, state)
        else:
            self._start_local(target_state, drafter_state, state or (spec.policy, None, None))
        freeze_long_lived()
        # `work` runs in the actor's default concurrency group; migrations arrive on a thread of
        # their own group and take the engine between two steps: the step loop lets a
        # waiting command in before its next step, so a move lands within one step.
        self._lock, self._count_lock, self._commands, self.seq = threading.Lock(), threading.Lock(), 0, 0

    def _start_local(self, target_state, drafter_state, state) -> None:
        from rlsched.executor.decode.drafters import ModelDrafter, make_drafter
        from rlsched.executor.engine.rollout import RolloutEngine
        from rlsched.executor.model.loading import load_model

        spec, idx = self.spec, self.idx
        policy, estimator, ngram_history = state
        self.model = load_model(Path(spec.target_dir), device=spec.device, dtype=spec.dtype).model
        if target_state is not None:
            self.model.load_state_dict(target_state)
        self.generator = torch.Generator(device=spec.device)
        self.drafter_model, drafter = None, None
        if spec.drafter in HOST_DRAFTERS:
            drafter = make_drafter(spec.drafter, **history_size(spec.ngram_max_history))
            if ngram_history is not None:
                drafter.history = ngram_history
        elif spec.drafter == "model":
            self.drafter_model = load_model(Path(spec.drafter_dir), device=spec.device, dtype=spec.dtype).model
            if drafter_state is not None:
                self.drafter_model.load_state_dict(drafter_state)
            drafter = ModelDrafter(
                self.drafter_model, spec.sampling, spec.max_batch, spec.drafter_max_len, self.generator
            )
        elif spec.drafter == "eagle":
            from rlsched.executor.decode.eagle import load_head
            from rlsched.executor.decode.eagle_drafter import EagleDrafter

            self.drafter_model = load_head(spec.drafter_dir, self.model)
            if drafter_state is not None:
                self.drafter_model.load_state_dict(drafter_state)
            drafter = EagleDrafter(self.drafter_model, self.model, spec.sampling, self.generator)
        self.engine = RolloutEngine(
            self.model,
            drafter,
            spec.cache_capacity,
            spec.max_batch,
            spec.sampling,
            policy,
            estimator,
            trace_dir=spec.trace_dir and Path(spec.trace_dir),
            k_max=spec.k_max,
            instance=idx,
            generator=self.generator,
            trace_tag=f"i{idx}",
            share_prompts=spec.share_prompts,
            probe_every=spec.probe_every,
        )

    def _start_vllm(self, target_state, drafter_state, state) -> None:
        from rlsched.executor.vllm.engine import VllmRolloutEngine

        spec, idx = self.spec, self.idx
        drafter = spec.drafter_dir if spec.drafter in ("model", "eagle") else spec.drafter
        self.engine = VllmRolloutEngine(
            Path(spec.target_dir),
            drafter,
            spec.sampling,
            spec.policy,
            max_batch=spec.max_batch,
            k_max=spec.k_max,
            max_len=spec.max_len,
            trace_dir=spec.trace_dir and Path(spec.trace_dir),
            seed=spec.seed,
            threads=spec.threads,
            dtype=spec.dtype,
            device=spec.device,
            cost=spec.cost,
            typical_ctx=spec.typical_ctx,
            instance=idx,
            probe_every=spec.probe_every,
            state=state,
            trace_tag=f"i{idx}",
            tp=spec.tp,
            gpu_memory_utilization=spec.gpu_memory_utilization,
        )
        self._load_vllm_weights(target_state, drafter_state)

    def _load_vllm_weights(self, target_state, drafter_state) -> None:
        from rlsched.executor.model.loading import load_config
        from rlsched.executor.model.saving import hf_weights

        if target_state is None:
            return
        draft = None
        if drafter_state is not None and self.spec.drafter == "model":
            draft = hf_weights(drafter_state, load_config(Path(self.spec.drafter_dir)))
        elif drafter_state is not None and self.spec.drafter == "eagle":
            from rlsched.executor.decode.eagle import read_head_config, vllm_weights

            draft = vllm_weights(drafter_state, read_head_config(self.spec.drafter_dir))
        self.engine.load_weights(hf_weights(target_state, load_config(Path(self.spec.target_dir))), draft)

    def _threads(self) -> None:
        """This thread's OpenMP and torch thread counts set to the instance's: Ray runs the
        actor's calls in threads of its own, which start from the process default (vLLM's CPU
        attention checks that the count it planned with is the count it runs with)."""
        if torch.get_num_threads() != self.spec.threads:
            torch.set_num_threads(self.spec.threads)

    def _command(self, fn):
        """Run fn on the engine between two steps (from the migration thread)."""
        self._threads()
        with self._count_lock:
            self._commands += 1
        try:
            with self._lock:
                return fn()
        finally:
            with self._count_lock:
                self._commands -= 1

    def where(self) -> tuple[int, str]:
        """(process id, Ray node id): KV moves only between instances on one node."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def _view(self) -> dict:
        """The engine's view, numbered: the driver keeps the newest (answers may arrive late).
        Called with the lock held."""
        self.seq += 1
        return dict(self.engine.view(), seq=self.seq)

    def begin(self, rl_step: int, prompt_of: np.ndarray, longest_reserve: int, seed: int) -> dict:
        self._threads()
        with self._lock:
            self.engine.rl_step = rl_step
            if self.generator is not None:
                self.generator.manual_seed(seed)
                self.engine.begin(prompt_of, longest_reserve)
            else:  # vLLM samples from torch's global generator (this process is the instance's own)
                self.engine.begin(prompt_of, longest_reserve, seed=seed)
            return self._view()

    def submit(self, items: list[tuple[int, Request]]) -> dict:
        with self._lock:
            self.engine.submit(items)
            return self._view()

    def work(self, max_steps: int) -> dict:
        """Up to max_steps engine steps; the finished samples, the view, the running totals."""
        self._threads()
        finished = []
        for _ in range(max_steps):
            while self._commands:  # a migration is waiting: let it in first
                time.sleep(1e-4)
            with self._lock:
                if not self.engine.has_work:
                    break
                finished += self.engine.work()
        with self._lock:
            e, totals = self.engine, self.engine.totals
            means = totals.get("accept_means")  # (vLLM's: its estimator lives in the engine core)
            if means is None:
                means = {d: e.estimator.mean(d) for d in e.estimator.drafters}
            return dict(finished=finished, view=self._view(), totals=totals, accept_means=means)

    def export_rows(self, indices, with_kv) -> dict:
        """Between two steps: these samples leave (those still here), with their KV for with_kv."""

        def export():  # KV rows travel as CPU tensors of the cache's dtype (Ray pickles them)
            return dict(moved=self.engine.export_rows(indices, set(with_kv)), view=self._view())

        return self._command(export)

    def import_rows(self, exported: dict) -> dict:
        """Between two steps: what another instance's export_rows gave (Ray hands it over once
        that call has finished)."""
        moved = exported["moved"]

        def land():
            self.engine.import_rows(moved)
            return dict(view=self._view())

        return self._command(land)

    def measured_cost(self):
        """The cost model this (vLLM) instance's steps are priced by: its policy's, else
        measured through it now (`VllmRolloutEngine.calibrate`)."""
        self._threads()
        with self._lock:
            e = self.engine
            if e.cost is None:
                e.cost = e.calibrate(self.spec.typical_ctx or self.spec.max_len // 2)
            return e.cost

    def echo(self, payload) -> int:
        """Receive a payload (the driver times KV transfers with it)."""
        return int(getattr(payload, "nbytes", 0))

    def resize(self, cache_capacity: int, drafter_max_len: int) -> None:
        """Room for longer requests: the KV budget, and the model drafter's cache rows."""
        with self._lock:
            self.engine.resize(cache_capacity, drafter_max_len)

    def sync_weights(self, target_state, drafter_state) -> None:
        self._threads()
        with self._lock:
            if self.spec.backend == "vllm":
                self._load_vllm_weights(target_state, drafter_state)
                return
            self.model.load_state_dict(target_state)
            if drafter_state is not None and self.drafter_model is not None:
                self.drafter_model.load_state_dict(drafter_state)

    def policy_state(self):
        with self._lock:
            return self.engine.policy_state()

    def flush(self) -> None:
        with self._lock:
            self.engine.close()


def actor_class(ray, n: int, spec: InstanceSpec):
    """The Ray actor class of `n` instances built from `spec`, and the spec they are given:
    threads are set per instance, migrations run in a concurrency group of their own, and on
    a GPU each instance holds one (Ray sets its CUDA_VISIBLE_DEVICES)."""
    remote = ray.remote(num_cpus=0, max_restarts=0, concurrency_groups={MOVES: 1})(InstanceWorker)
    if spec.device.startswith("cuda"):
        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus < n:
            raise UserError(
                f"{n} rollout instances on '{spec.device}' need {n} GPUs, Ray sees {gpus:g}; "
                "lower --instances or add GPUs"
            )
        return remote.options(num_gpus=1), replace(spec, device="cuda")
    return remote, spec
