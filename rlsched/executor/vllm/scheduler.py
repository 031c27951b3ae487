"""rlsched's draft policies in any vLLM engine: `PolicyScheduler`, configured by vLLM's own config.

A user adds engine arguments, nothing else:

    vllm serve MODEL --speculative-config '{"method": "draft_model", "model": DRAFTER, "num_speculative_tokens": 6}'
        --scheduler-cls rlsched.vllm.PolicyScheduler
        --additional-config '{"rlsched": {"policy": "goodput", "cost_model": "h100-sxm", "trace_dir": "traces"}}'

and `vllm.LLM(...)`, `AsyncEngineArgs(...)` or verl's `engine_kwargs.vllm` take the same keys.
vLLM resolves `scheduler_cls` by its qualified name inside the engine-core process, whichever
way the engine runs (the in-process `LLM`, the multiprocess engine core, `AsyncLLM`, the
OpenAI-compatible server, each data-parallel engine), and hands the scheduler the whole
`VllmConfig`; `additional_config` is vLLM's place for a plug-in's own settings and travels with
that config into every process. A general plugin (an entry point) would need a package
installed in the engine's environment and runs before any config exists, so it could not know
the policy. The `rlsched` block (`EngineHookConfig`): the policy (as `rlsched run` spells it:
a name, a spec, or a policy file), the cost model a priced policy prices steps with (a
`rlsched fit` file, or a hardware preset: the roofline of the served model on it), the trace
folder, the probe interval and a seed. The drafter, k_max (`num_speculative_tokens`), the batch
limit (`max_num_seqs`) and the tensor parallelism are vLLM's own settings.

The base is chosen at start-up: vLLM's `AsyncScheduler` where vLLM turned async scheduling on
(its GPU runner with an EAGLE or draft-model drafter), else its `Scheduler`; a policy's
per-step k is the scheduler output's `num_spec_tokens_to_schedule` either way (the async
scheduler sizes its draft placeholders from it), and a per-request k cuts each request's drafts
(synchronous) or placeholders (async).

Requests come as a server gets them: each is a sample numbered in arrival order, its prompt the
first sample's with the same prompt tokens (the n samples of a group share one). A weight update
(`reset_prefix_cache`, which frameworks call after loading weights and vLLM's sleep calls)
starts a new window: the records' `rl_step` goes up by one (the trace marks the update), the
policy and the drafters' running acceptance carry on. Traces: one step record per engine step
and one sample record per finished request, journaled as written, in parts tagged with the
engine's data-parallel rank and process id, so engines and restarts never share a part.

Bad settings stop the engine at start-up with one line naming the field: raised as the
UserError where the engine runs in the caller's process, printed as one line before the
engine-core process exits (2) where it runs in its own.
"""

from __future__ import annotations

import multiprocessing
import sys

from rlsched.errors import UserError
from rlsched.executor.vllm.engine_hook import EngineHook, register_utility
from rlsched.executor.vllm.hook import StepHook
from rlsched.executor.vllm.plugin import patch_runner
from rlsched.executor.vllm.settings import KEY, EngineHookConfig, hook_config

__all__ = ["KEY", "EngineHookConfig", "PolicyScheduler", "scheduler_for"]

WINDOW = 4096  # samples an idle engine keeps per-sample counts for before it starts afresh


# ----------------------------------------------------------------------------- the scheduler


def _stop(error: UserError) -> None:
    """A bad setting where the engine core runs in its own process: one line, exit 2 (vLLM
    logs an Exception raised here with its traceback)."""
    if multiprocessing.parent_process() is None:
        raise error
    print(f"rlsched: {error}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _mixin(base):
    class PolicySchedulerOf(base):
        """vLLM's `base` scheduler, with rlsched's hook (None: vLLM as is)."""

        hook: StepHook | None = None

        def __init__(self, vllm_config, *args, **kwargs):
            super().__init__(vllm_config, *args, **kwargs)
            patch_runner()  # a runner in this process (the plugin patches those in others)
            try:
                cfg = hook_config(vllm_config)
                self.hook = None if cfg is None else EngineHook(cfg, vllm_config, self)
                register_utility()
            except UserError as e:
                _stop(e)

        def add_request(self, request) -> None:
            if self.hook is not None:
                self.hook.admit(request)
            super().add_request(request)

        def _update_after_schedule(self, scheduler_output) -> None:
            # the step is scheduled and its requests' counts not yet advanced: the policy
            # chooses here, before the async base sizes its draft placeholders from the choice
            if self.hook is not None and scheduler_output.total_num_scheduled_tokens > 0:
                self.hook.before_step(self, scheduler_output)
            super()._update_after_schedule(scheduler_output)
            if self.hook is not None and self.hook._k_of and hasattr(self, "_spec_token_placeholders"):
                for req_id, k in self.hook._k_of.items():  # async: each request's placeholders, its own k
                    r = self.requests.get(req_id)
                    if r is not None and len(r.spec_token_ids) > k:
                        r.spec_token_ids = r.spec_token_ids[:k]

        def update_from_output(self, scheduler_output, model_runner_output):
            if self.hook is not None and scheduler_output.total_num_scheduled_tokens > 0:
                self.hook.after_step(scheduler_output, model_runner_output)
            return super().update_from_output(scheduler_output, model_runner_output)

        def update_draft_token_ids(self, draft_token_ids) -> None:
            if self.hook is not None:
                self.hook.trim(draft_token_ids)
            super().update_draft_token_ids(draft_token_ids)

        def _free_request(self, request, *args, **kwargs):
            if isinstance(self.hook, EngineHook):
                self.hook.finished(request)
                if not self.has_requests() and len(self.hook.index_of) > WINDOW:
                    self.hook.new_window(weights_changed=False)
            return super()._free_request(request, *args, **kwargs)

        def reset_prefix_cache(self, *args, **kwargs) -> bool:
            if isinstance(self.hook, EngineHook):
                self.hook.new_window(weights_changed=True)
            return super().reset_prefix_cache(*args, **kwargs)

        def shutdown(self) -> None:
            if isinstance(self.hook, EngineHook):
                self.hook.recorder.close()
            super().shutdown()

    PolicySchedulerOf.__name__ = PolicySchedulerOf.__qualname__ = f"PolicyScheduler[{base.__name__}]"
    return PolicySchedulerOf


_CLASSES: dict[type, type] = {}


def scheduler_for(async_scheduling: bool) -> type:
    """rlsched's scheduler over vLLM's Scheduler or AsyncScheduler."""
    if async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as base
    if base not in _CLASSES:
        _CLASSES[base] = _mixin(base)
    return _CLASSES[base]


class PolicyScheduler:
    """What `scheduler_cls` names: an instance of rlsched's scheduler over the base vLLM's
    config asks for (`scheduler_for`)."""

    def __new__(cls, vllm_config, *args, **kwargs):
        base = scheduler_for(bool(vllm_config.scheduler_config.async_scheduling))
        return base(vllm_config, *args, **kwargs)


def attach(llm, hook: StepHook) -> None:
    """Give the PolicyScheduler of an `llm` whose engine core runs in this process a StepHook
    of the caller's own (a test that drives the hook's mechanics directly; engines started by
    arguments build theirs, `engine_hook.EngineHook`)."""
    core = llm.llm_engine.engine_core
    scheduler = getattr(core, "engine_core", core).scheduler
    if type(scheduler) not in _CLASSES.values():
        raise RuntimeError("the vLLM engine was not started with rlsched.vllm.PolicyScheduler")
    scheduler.hook = hook
