"""Rollouts of an engine's own, before its first: a warm-up (`warm_up`), and step costs measured
through the engine for a priced policy started without a cost model (`measure_step_costs`: a
KSweep rollout per batch size, its step records priced as a MeasuredCostModel)."""

from __future__ import annotations

import json
import pickle

import numpy as np

from rlsched.executor.vllm.engine_hook import ask
from rlsched.policies.types import EngineState, StepOutcome, Strategy


class KSweep:
    """A DraftPolicy that drafts k = 0, 1, ..., k_max, 0, ... step by step, every row alike
    (calibrating step costs; testing that any per-step k is lossless)."""

    name, needs_acceptance, observes = "sweep", False, False

    def __init__(self, drafter: str, k_max: int):
        self.drafter, self.k_max = drafter, k_max

    def choose(self, state: EngineState) -> Strategy:
        k = state.step % (self.k_max + 1)
        return Strategy(self.drafter, k) if k else Strategy()

    def observe(self, outcome: StepOutcome) -> None:
        pass


def cost_records(records: list[dict], ctx_per_row: int, sizes) -> list[dict]:
    """KSweep runs' step records as profile records (kinds verify, draft, prefill) of the
    batch sizes swept (not the few steps where a batch had begun to drain), each decode step
    priced at the sweep's nominal context per row: what MeasuredCostModel reads."""
    out = []
    for r in records:
        if r["kind"] == "prefill":
            out.append(dict(r, draft_ms=0.0, verify_ms=0.0))
        elif r["kind"] == "decode" and r["batch"] in sizes and r["drafted"] == r["batch"] * r["k"]:
            ctx = r["batch"] * ctx_per_row
            out.append(dict(r, kind="verify", ctx_tokens=ctx, draft_ms=0.0))
            if r["k"] > 0:
                out.append(dict(r, kind="draft", ctx_tokens=ctx, verify_ms=0.0))
    return out


def _sweep_k(engine) -> tuple[str, int]:
    """The drafter and the k a KSweep of `engine` runs to: k = 0 only without a model drafter
    (an n-gram drafter finds nothing to draft in random tokens)."""
    drafter = "off" if engine.plan is None else engine.plan["drafter"]
    return drafter, engine.k_max if drafter in ("model", "eagle") else 0


def _swept(engine, k: int, sizes, new: int, typical_ctx: int, params) -> tuple[list[dict], int]:
    """KSweep rollouts through `engine`, one per batch size in `sizes` (each a window of its
    own), every request a prompt of about `typical_ctx` random tokens and `new` to generate
    with vLLM's sampling `params`: the step records the engine core's hook kept aside
    (`capture`), and the prompts' length."""
    from vllm.inputs import TokensPrompt

    drafter, _ = _sweep_k(engine)
    prompt_len = max(8, min(typical_ctx, engine.max_model_len - new - 1))
    rng = np.random.default_rng(engine.seed)
    vocab = int(json.loads((engine.target_dir / "config.json").read_text())["vocab_size"])
    ask(engine.llm, "policy", pickle.dumps((KSweep(drafter, k), None)))
    ask(engine.llm, "capture", True)
    try:
        for b in sizes:
            ask(engine.llm, "begin", engine.rl_step, engine.instance)
            prompts = [TokensPrompt(prompt_token_ids=rng.integers(1, vocab, prompt_len).tolist()) for _ in range(b)]
            engine.llm.generate(prompts, [params] * b, use_tqdm=False)
    finally:
        records = ask(engine.llm, "capture", False)
    return records, prompt_len


def measure_step_costs(engine, typical_ctx: int):
    """Step costs measured through `engine` (a VllmRolloutEngine; a few seconds): one KSweep
    rollout per batch size up to max_batch, every request alike (a prompt of about
    `typical_ctx` random tokens, 2 sweeps of k = 0..k_max long), priced as a
    MeasuredCostModel. The engine's own policy is handed over afterwards."""
    import pandas as pd
    from vllm import SamplingParams as VP

    from rlsched.costs.measured import MeasuredCostModel

    _, k = _sweep_k(engine)
    new = max(16, 2 * (k + 1) * (k + 2) // 2 + k + 2)  # two sweeps at full acceptance, and room for the last
    sizes = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < engine.max_batch} | {engine.max_batch})
    params = VP(temperature=1.0, max_tokens=new, ignore_eos=True, detokenize=False, seed=None)
    records, prompt_len = _swept(engine, k, sizes, new, typical_ctx, params)
    return MeasuredCostModel(pd.DataFrame(cost_records(records, prompt_len + new // 2, sizes)))


def warm_up(engine, typical_ctx: int) -> None:
    """One short rollout through `engine` (a VllmRolloutEngine), its step records dropped: vLLM
    warms its kernels up at start-up only when it compiles or captures graphs, so under
    enforce_eager (the CPU build) the first forward of an engine takes seconds that belong to
    its start, not to the first rollout's steps. A batch of max_batch prompts of about
    `typical_ctx` random tokens, sampled as the engine's rollouts are (log-probs out: their
    first computation is the slow one), drafting as KSweep does."""
    from vllm import SamplingParams as VP

    _, k = _sweep_k(engine)
    s = engine.sampling
    params = VP(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        max_tokens=k + 3,
        logprobs=0,
        ignore_eos=True,
        detokenize=False,
    )
    _swept(engine, k, [engine.max_batch], k + 3, typical_ctx, params)
