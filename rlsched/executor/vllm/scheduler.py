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
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlsched.atomic import check_writable, json_text, write_text_atomic
from rlsched.errors import UserError, describe_validation_error
from rlsched.executor.engine.recorder import Recorder, sample_record
from rlsched.executor.vllm.hook import StepHook
from rlsched.executor.vllm.plugin import patch_runner
from rlsched.policies.acceptance import AcceptanceEstimator
from rlsched.policies.probe import PROBE_EVERY, prober_for
from rlsched.policies.registry import as_spec, run_words

KEY = "rlsched"  # additional_config[KEY]
DRAFTERS = {"draft_model": "model", "eagle3": "eagle", "eagle": "eagle", "ngram": "ngram"}
WINDOW = 4096  # samples an idle engine keeps per-sample counts for before it starts afresh


class EngineHookConfig(BaseModel):
    """`additional_config["rlsched"]`: what rlsched adds to a vLLM engine."""

    model_config = ConfigDict(extra="forbid")

    policy: str = Field(description="a policy name or spec (goodput, static:K, ...) or a policy file")
    cost_model: str | None = Field(
        None, description="a `rlsched fit` cost file, or a hardware preset (the served model's roofline on it)"
    )
    trace_dir: str | None = Field(None, description="folder of the engine core's step and sample records")
    probe_every: int | None = Field(PROBE_EVERY, ge=1)
    seed: int = Field(0, ge=0)


def hook_config(vllm_config) -> EngineHookConfig | None:
    """The engine's `rlsched` block (None: vLLM as is); UserError naming the field."""
    extra = vllm_config.additional_config or {}
    block = extra.get(KEY) if isinstance(extra, dict) else None
    if block is None:
        return None
    where = f"additional_config.{KEY}"
    if not isinstance(block, dict):
        raise UserError(f'{where} must be a mapping such as {{"policy": "goodput"}} (got {type(block).__name__})')
    unknown = [k for k in block if k not in EngineHookConfig.model_fields]
    if unknown:
        raise UserError(
            f"{where} has an unknown field {unknown[0]!r}; its fields are {', '.join(EngineHookConfig.model_fields)}"
        )
    try:
        return EngineHookConfig.model_validate(block)
    except ValidationError as e:
        raise UserError(describe_validation_error(e, prefix=where)) from None


# ----------------------------------------------------------------------------- built in the engine core


def engine_facts(vllm_config) -> dict:
    """What the policy is built for, from vLLM's config: drafter, k_max, batch limit, tp, model."""
    spec = vllm_config.speculative_config
    method = None if spec is None else spec.method
    if method is not None and method not in DRAFTERS:
        raise UserError(
            f"speculative_config.method {method!r}: rlsched's policies choose the draft length of "
            f"{', '.join(DRAFTERS)} drafters"
        )
    parallel = vllm_config.parallel_config
    drafter = DRAFTERS[method] if method else "off"
    return dict(
        drafter=drafter,
        name=drafter,
        k_max=int(spec.num_speculative_tokens) if spec is not None else 0,
        max_batch=int(vllm_config.scheduler_config.max_num_seqs),
        tp=int(parallel.tensor_parallel_size),
        rank=int(getattr(parallel, "data_parallel_index", None) or parallel.data_parallel_rank or 0),
        model=str(vllm_config.model_config.model),
        max_len=int(vllm_config.model_config.max_model_len),
        world=int(parallel.world_size),
    )


def write_engine_file(folder: Path, tag: str, cfg: EngineHookConfig, vllm_config, facts: dict) -> None:
    """`engine-<tag>.json` in the trace folder: what this engine ran (rlsched's settings and
    vLLM's own scheduling arguments), for `replay` and `report`. The folder's parent must exist."""
    import vllm

    where = f"additional_config.{KEY}.trace_dir"
    if not folder.absolute().parent.is_dir():
        raise UserError(f"{where} '{folder}': its parent folder does not exist; create it or name another")
    check_writable(folder, where)
    sched = vllm_config.scheduler_config
    record = dict(
        format="rlsched-engine",
        version=1,
        rlsched=cfg.model_dump(),
        **{k: facts[k] for k in ("drafter", "name", "k_max", "max_batch", "tp", "rank", "model", "max_len")},
        vllm=vllm.__version__,
        max_num_batched_tokens=int(sched.max_num_batched_tokens),
        enable_chunked_prefill=bool(sched.enable_chunked_prefill),
        enable_prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
        async_scheduling=bool(sched.async_scheduling),
        pid=os.getpid(),
        started=time.time(),
    )
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(folder / f"engine-{tag}.json", json_text(record) + "\n")


def model_spec(hf_config, name: str):
    """The simulator's ModelSpec of an HF config (the roofline's architecture numbers)."""
    from rlsched.config import ModelSpec

    heads = int(hf_config.num_attention_heads)
    return ModelSpec(
        name=name,
        hidden=int(hf_config.hidden_size),
        layers=int(hf_config.num_hidden_layers),
        heads=heads,
        kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads),
        intermediate=int(hf_config.intermediate_size),
        vocab=int(hf_config.vocab_size),
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )


def engine_cost_model(text: str | None, vllm_config, facts: dict):
    """The cost model of `cost_model`: a fit file's, or the roofline of the served model (and
    its draft model) on a hardware preset at vLLM's tensor parallelism."""
    if text is None:
        return None
    drafter, name = facts["drafter"], facts["name"]
    if text.endswith(".json") or os.sep in text or Path(text).exists():
        from rlsched.costs.costfile import load_cost_model

        return load_cost_model(Path(text), drafters=[name] if drafter != "off" else [])
    from rlsched.config import AcceptanceSpec, DrafterSpec, HardwareSpec, load_preset_data
    from rlsched.costs.roofline import RooflineCostModel

    try:
        hardware = HardwareSpec.model_validate(load_preset_data("hardware", text))
    except UserError as e:
        raise UserError(f"additional_config.{KEY}.cost_model: {e}") from None
    drafters = []
    if drafter != "off":
        spec = vllm_config.speculative_config
        draft = model_spec(spec.draft_model_config.hf_config, "drafter") if drafter == "model" else None
        drafters.append(DrafterSpec(name=name, kind=drafter, model=draft, acceptance=AcceptanceSpec(mean=0.6)))
    target = model_spec(vllm_config.model_config.hf_config, facts["model"])
    return RooflineCostModel(hardware, target, drafters, facts["tp"])


def make_policy(cfg: EngineHookConfig, vllm_config, facts: dict):
    """rlsched's DraftPolicy for this engine (None: vLLM's own draft length), checked against
    the served model (a policy file learned for another architecture is refused). The engine's
    one drafter is named by its kind (`facts["name"]`), or as a policy file names its drafter."""
    from rlsched.policies.draft import PolicyContext
    from rlsched.policies.policyfile import SHAPE_KEYS, check_model_shape, load_policy_file
    from rlsched.policies.registry import make_draft_policy

    where = f"additional_config.{KEY}.policy"
    try:
        spec = as_spec(cfg.policy, "vllm")
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    if spec.drafts and facts["drafter"] == "off":
        raise UserError(f"{where} '{spec}' drafts, but the engine has no speculative_config; add one")
    if spec.file is not None:
        served = model_spec(vllm_config.model_config.hf_config, facts["model"])
        shape = {k: getattr(served, k) for k in SHAPE_KEYS}
        pf = load_policy_file(spec.file, kinds=(spec.family,) if spec.family else ("table", "twostate"))
        check_model_shape(pf, spec.file, shape, facts["model"])
        facts["name"] = pf.drafter  # the engine's one drafter, as the file names it
    cost = engine_cost_model(cfg.cost_model, vllm_config, facts)
    if spec.priced and cost is None:
        raise UserError(
            f"{where} '{spec}' prices steps: set additional_config.{KEY}.cost_model to a `rlsched fit` "
            "cost file or a hardware preset (h100-sxm, h200, a100-80gb)"
        )
    if not spec.drafts:
        return None
    ctx = PolicyContext(
        cost,
        (facts["name"],),
        k_max=facts["k_max"],
        max_batch=facts["max_batch"],
        typical_ctx=facts["max_len"] // 2,
        seed=cfg.seed,
        calibrate=True,
    )
    return make_draft_policy(spec, ctx, run_words("vllm"))


class EngineHook(StepHook):
    """A StepHook that runs inside vLLM's engine core and manages itself: requests become
    samples as they arrive, finished ones become sample records, weight updates start windows."""

    def __init__(self, cfg: EngineHookConfig, vllm_config):
        facts = engine_facts(vllm_config)
        policy = make_policy(cfg, vllm_config, facts)
        names = () if facts["drafter"] == "off" else (facts["name"],)
        self.recorder = Recorder(None)
        if cfg.trace_dir is not None:
            tag = f"e{facts['rank']}-{os.getpid()}"
            write_engine_file(Path(cfg.trace_dir), tag, cfg, vllm_config, facts)
            self.recorder = Recorder(Path(cfg.trace_dir), tag)
        prober = None if policy is None else prober_for(policy, names, cfg.probe_every)
        super().__init__(
            policy,
            AcceptanceEstimator(names),
            names[0] if names else "off",
            facts["k_max"],
            instance=facts["rank"],
            prober=prober,
            record=self.recorder.step if self.recorder.on else None,
        )
        self.prompt_ids: dict[tuple, int] = {}
        self.prompt_of: list[int] = []
        self._joining: list = []  # requests admitted since the last step
        self.begin(np.zeros(0, dtype=np.int64))

    def admit(self, request) -> None:
        self._joining.append(request)

    def before_step(self, scheduler, out) -> None:
        if self._joining:
            self._join()
        super().before_step(scheduler, out)

    def _join(self) -> None:
        """The requests admitted since the last step join the window as samples."""
        prompts = []
        for r in self._joining:
            self.index_of.setdefault(r.request_id, len(self.index_of))
            key = tuple(r.prompt_token_ids or ())
            prompts.append(self.prompt_ids.setdefault(key, len(self.prompt_ids)))
        self.prompt_of += prompts
        self.estimator.add_samples(np.array(prompts, dtype=np.int64))
        self._joining = []

    def finished(self, request) -> None:
        """A request left the engine (finished or aborted): its sample record."""
        if request.request_id not in self.index_of:
            if request in self._joining:
                self._joining.remove(request)
            return
        index = self.index_of[request.request_id]
        drafted, accepted, rejected, _ = self.take_counts(index)
        self.estimator.finish(np.array([index], dtype=np.int64))  # its siblings gain from its trials
        if self.recorder.on:
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
                self.hook = None if cfg is None else EngineHook(cfg, vllm_config)
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
    """Give an in-process `llm`'s PolicyScheduler `hook` (the executor's own engine, which
    numbers its samples itself)."""
    core = llm.llm_engine.engine_core
    scheduler = getattr(core, "engine_core", core).scheduler
    if type(scheduler) not in _CLASSES.values():
        raise RuntimeError("the vLLM engine was not started with rlsched.vllm.PolicyScheduler")
    scheduler.hook = hook
