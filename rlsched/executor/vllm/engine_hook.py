"""The hook `PolicyScheduler` runs in vLLM's engine core, and what a client asks it.

`EngineHook` manages itself: requests become samples as they arrive (their prompt: the first
sample's with the same prompt tokens), finished ones become sample records, a weight update
(`reset_prefix_cache`) starts a new window with the records' `rl_step` one up.

A client that keeps its own books (`rlsched run`, `executor/vllm/engine.py`) names its requests
`rlsched:<prompt>:<sample>.<n>` (`run_request_id`) and talks to the hook through vLLM's utility
channel (`ask`): the engine core runs a client's utility call by name (as it runs
`reset_prefix_cache` or `collective_rpc`), and the scheduler adds one, `rlsched`, that hands the
call to the hook's `call_<name>` method. Arguments and results are plain data (a policy travels
pickled, as bytes), so none of vLLM's insecure serialization is needed. Such requests are
grouped by the client's prompt (a migrated sample, resubmitted with its partial response,
stays in its group), and their sample records are the client's to write: the hook keeps each
one's chain counts until the client takes them (`call_take`).
"""

from __future__ import annotations

import os
import pickle
import re
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from rlsched.executor.engine.recorder import Recorder, sample_record
from rlsched.executor.vllm.hook import StepHook
from rlsched.executor.vllm.settings import EngineHookConfig, engine_facts, make_policy, write_engine_file
from rlsched.policies.acceptance import AcceptanceEstimator
from rlsched.policies.probe import prober_for

UTILITY = "rlsched"  # the engine core's utility method through which a client asks the hook
_RUN_ID = re.compile(r"^(rlsched:(\d+):\d+\.\d+)")  # (vLLM appends its own suffix to a request id)


def run_request_id(prompt: int, index: int, n: int) -> str:
    """The request id of a client's sample `index` of prompt `prompt`, its `n`-th submission."""
    return f"rlsched:{prompt}:{index}.{n}"


def utility(llm, method: str, *args):
    """Call the engine core's utility `method` (one of vLLM's EngineCore methods), in whichever
    process the engine core runs."""
    core = llm.llm_engine.engine_core
    if hasattr(core, "call_utility"):  # the multiprocess engine core
        return core.call_utility(method, *args)
    return getattr(core.engine_core, method)(*args)


def ask(llm, name: str, *args):
    """Call the hook of `llm`'s engine core (`EngineHook.call_<name>`)."""
    return utility(llm, UTILITY, name, list(args))


def register_utility() -> None:
    """Give vLLM's EngineCore the `rlsched` utility method (once per process)."""
    from vllm.v1.engine.core import EngineCore

    if hasattr(EngineCore, UTILITY):
        return

    def rlsched(self, name: str, args: list):
        hook = getattr(self.scheduler, "hook", None)
        call = getattr(hook, f"call_{name}", None) if isinstance(hook, EngineHook) else None
        if call is None:
            raise ValueError(f"the engine's scheduler answers no rlsched call {name!r}")
        return call(*args)

    setattr(EngineCore, UTILITY, rlsched)


class EngineHook(StepHook):
    """A StepHook that runs inside vLLM's engine core, built from the engine's `rlsched` block."""

    def __init__(self, cfg: EngineHookConfig, vllm_config, scheduler):
        facts = engine_facts(vllm_config)
        policy = make_policy(cfg, vllm_config, facts)
        names = () if facts["drafter"] == "off" else (facts["name"],)
        self.recorder = Recorder(None)
        self._engine_file: tuple | None = None
        if cfg.trace_dir is not None:
            tag = f"e{facts['rank']}-{os.getpid()}"
            write_engine_file(Path(cfg.trace_dir), tag, cfg, vllm_config, facts)
            self._engine_file = (Path(cfg.trace_dir), tag, cfg, vllm_config, facts)
            self.recorder = Recorder(Path(cfg.trace_dir), tag)
        super().__init__(
            policy,
            AcceptanceEstimator(names),
            names[0] if names else "off",
            facts["k_max"],
            instance=facts["rank"],
            prober=None if policy is None else prober_for(policy, names, cfg.probe_every),
            record=self.recorder.step if self.recorder.on else None,
        )
        self.scheduler, self.probe_every, self.max_running = scheduler, cfg.probe_every, 0
        self.prompt_ids: dict[tuple, int] = {}
        self.prompt_of: list[int] = []
        self._joining: list = []  # requests admitted since the last step
        self.left: dict[str, dict] = {}  # a client's requests that left: what it takes (`call_take`)
        self._carried: dict[str, tuple] = {}  # a client's migrated requests: counts they bring
        self._captured: list | None = None
        self.begin(np.zeros(0, dtype=np.int64))

    def admit(self, request) -> None:
        self._joining.append(request)

    def before_step(self, scheduler, out) -> None:
        if self._joining:
            self._join()
        self.max_running = max(self.max_running, len(scheduler.running))
        super().before_step(scheduler, out)

    def _join(self) -> None:
        """The requests admitted since the last step join the window as samples."""
        prompts, carried = [], []
        for r in self._joining:
            index = self.index_of.setdefault(r.request_id, len(self.index_of))
            run = _RUN_ID.match(r.request_id)
            key = ("run", run.group(2)) if run else tuple(r.prompt_token_ids or ())
            prompts.append(self.prompt_ids.setdefault(key, len(self.prompt_ids)))
            if run and run.group(1) in self._carried:
                carried.append((index, self._carried.pop(run.group(1))))
        self.prompt_of += prompts
        self.estimator.add_samples(np.array(prompts, dtype=np.int64))
        for index, (chain, counts) in carried:
            self.add_counts(index, chain)
            for d, (succ, fail) in counts.items():
                if d in self.estimator.drafters:
                    self.estimator.add_sample_counts(d, index, succ, fail)
        self._joining = []

    def finished(self, request) -> None:
        """A request left the engine (finished or aborted): its sample record, or for a
        client's request what the client takes."""
        if request.request_id not in self.index_of:
            if request in self._joining:
                self._joining.remove(request)
            return
        index = self.index_of[request.request_id]
        drafted, accepted, rejected, verify_steps = self.take_counts(index)
        run = _RUN_ID.match(request.request_id)
        if run:
            counts = {}
            if request.status.name == "FINISHED_ABORTED":  # leaving to migrate
                self.estimator.retire(self._ids)  # pending trials applied before they are read
                counts = {d: self.estimator.take_sample_counts(d, index) for d in self.estimator.drafters}
            else:
                self.estimator.finish(np.array([index], dtype=np.int64))
            chain = [drafted, accepted, rejected, verify_steps]
            self.left[run.group(1)] = dict(chain=chain, preemptions=int(request.num_preemptions), counts=counts)
            return
        self.estimator.finish(np.array([index], dtype=np.int64))  # its siblings gain from its trials
        if self.recorder.on and self._captured is None:
            acceptance = {} if self.drafter == "off" else {self.drafter: self.estimator.from_trials(accepted, rejected)}
            req = SimpleNamespace(sample_id=index, prompt_id=self.prompt_of[index], prompt=request.prompt_token_ids)
            # fmt: off
            self.recorder.sample(sample_record(
                self.rl_step, req, self.instance, request.num_output_tokens, time.perf_counter() - self._t0,
                int(request.num_preemptions), 0, drafted, accepted, rejected, acceptance,
            ))
            # fmt: on

    def new_window(self, weights_changed: bool) -> None:
        """Per-sample counts start afresh (the running means carry on); after a weight update
        the records' rl_step goes up by one."""
        self.fresh_samples(np.zeros(0, dtype=np.int64))
        self.prompt_ids.clear()
        self.prompt_of = []
        if weights_changed:
            self.rl_step += 1
        self.recorder.flush()

    # --- what a client asks (`ask`) ----------------------------------------------------------

    def call_begin(self, rl_step: int, instance: int) -> None:
        """A client's rollout starts: a new window of records tagged (rl_step, instance), the
        engine's step count from 0."""
        self.new_window(weights_changed=False)
        self.rl_step, self.instance, self.step, self.scheduled = rl_step, instance, 0, 0
        self.hook_s, self.max_running, self._t0 = 0.0, 0, time.perf_counter()
        self.left.clear()

    def call_policy(self, blob: bytes, name: str | None = None) -> None:
        """Run the pickled (policy, estimator or None) from here on (None: vLLM's own draft length);
        `name`, the policy's spec, goes into the engine file for replay."""
        policy, estimator = pickle.loads(blob)
        if name is not None and self._engine_file is not None:
            folder, tag, cfg, vllm_config, facts = self._engine_file
            write_engine_file(folder, tag, cfg.model_copy(update={"policy": name}), vllm_config, facts)
        names = tuple(self.estimator.drafters)
        if estimator is not None:
            self.estimator = estimator
        self.policy = policy
        self.prober = None if policy is None else prober_for(policy, names, self.probe_every)
        self.needs_acceptance = policy is None or getattr(policy, "needs_acceptance", True)
        self.observes = policy is not None and getattr(policy, "observes", True)

    def call_state(self) -> bytes:
        """The pickled (policy, estimator): what the engine learnt, for a client's checkpoint."""
        self.estimator.retire(self._ids)
        return pickle.dumps((self.policy, self.estimator))

    def call_capture(self, on: bool) -> list | None:
        """On: step records are kept here, not written, and no sample records are written; off:
        the records kept since, handed over."""
        kept, self._captured = self._captured, [] if on else None
        self.record = self._captured.append if on else (self.recorder.step if self.recorder.on else None)
        return None if on else kept

    def call_take(self, ids: list) -> dict:
        """What the client's requests `ids` (`run_request_id`) left with, removed: chain counts
        (drafted, accepted, rejected, verify steps), preemptions, and, for a request aborted to
        migrate, its per-sample acceptance counts."""
        return {i: self.left.pop(i) for i in ids if i in self.left}

    def call_carry(self, request_id: str, chain: list, counts: dict) -> None:
        """A migrated request (submitted just before) brings its counts."""
        self._carried[request_id] = (chain, {d: tuple(c) for d, c in counts.items()})

    def call_view(self) -> dict:
        """The client's running and waiting requests, their context, and the free KV tokens."""
        s = self.scheduler
        running = [(r.request_id, r.num_tokens) for r in s.running if _RUN_ID.match(r.request_id)]
        waiting = [r.request_id for r in s.waiting if _RUN_ID.match(r.request_id)]
        key = lambda q: _RUN_ID.match(q).group(1)  # noqa: E731
        return dict(
            running=[key(q) for q, _ in running],
            running_ctx=[n for _, n in running],
            waiting=[key(q) for q in waiting],
            kv_free_tokens=int(s.kv_cache_manager.block_pool.get_num_free_blocks() * s.block_size),
        )

    def call_totals(self) -> dict:
        """The window's engine steps, the hook's own seconds, the most requests running at once,
        the drafters' running acceptance."""
        means = {d: self.estimator.mean(d) for d in self.estimator.drafters}
        return dict(steps=self.step, hook_s=self.hook_s, max_running=self.max_running, accept_means=means)

    def call_flush(self) -> None:
        """Write the records so far as trace parts."""
        self.recorder.flush()
