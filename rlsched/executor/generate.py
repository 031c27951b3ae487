"""`rlsched generate`: batched speculative rollouts from a prompts file, written to a folder.

Everything the user gives is checked before anything is written (model and drafter folders,
vocabularies, prompts, sampling, policy), so bad input leaves no folder behind. The run then
writes, under `out/`:

- `traces/steps/`, `traces/samples/`: the engine's trace parts, journaled every record (a run
  killed mid-way keeps every completed step readable);
- `samples.parquet`: per sample the prompt id, the token ids, the text and the per-token
  target log-probs (what an RL update needs);
- `summary.json`: tokens/s, mean accepted length and the run's settings.
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
import torch

from rlsched.errors import UserError
from rlsched.executor.folders import check_drafter_vocab, eos_id, prepare_out, resolve_model_dir
from rlsched.executor.gcfreeze import freeze_long_lived
from rlsched.executor.prompts import Prompt, load_prompts

MARKER = "summary.json"


@dataclass
class GenerateArgs:
    model: str = "builtin"
    drafter: str = "builtin"
    policy: str = "goodput"
    prompts: Path | None = None
    n: int = 4
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    k_max: int = 6
    max_batch: int = 64
    kv_budget: int | None = None  # tokens; default: every running row at its longest
    cost_model: str = "auto"  # auto (profile at start), or a `rlsched profile` folder
    ignore_eos: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    threads: int | None = None
    instances: int = 1  # more than 1: a Ray pool (rlsched.executor.pool)
    realloc: str = "none"  # the pool's ReallocPolicy
    compile: bool = False  # decode and verify forwards through compiled graphs (executor/compiled.py)


# --- checking inputs -------------------------------------------------------------------------

def _sampling(a: GenerateArgs):
    from rlsched.executor.sampling import SamplingParams

    try:
        return SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p)
    except ValueError as e:
        raise UserError(f"sampling: {e}") from None


def _check_numbers(a: GenerateArgs) -> None:
    for name, v, lo in (("n", a.n, 1), ("max_tokens", a.max_tokens, 1), ("max_batch", a.max_batch, 1),
                        ("k_max", a.k_max, 1)):
        if v < lo:
            raise UserError(f"--{name.replace('_', '-')} must be >= {lo} (got {v})")
    if a.kv_budget is not None and a.kv_budget < 1:
        raise UserError(f"--kv-budget must be >= 1 token (got {a.kv_budget})")
    if a.threads is not None and a.threads < 1:
        raise UserError(f"--threads must be >= 1 (got {a.threads})")
    if a.instances < 1:
        raise UserError(f"--instances must be >= 1 (got {a.instances})")
    from rlsched.policies.realloc import make_realloc_policy

    make_realloc_policy(a.realloc)  # an unknown name: one line, before anything is loaded
    if a.compile and a.instances > 1:
        raise UserError("--compile runs in this process: use it with --instances 1")
    if a.instances > 1:
        from rlsched.executor.pool import require_ray

        require_ray()


# --- the run ---------------------------------------------------------------------------------

@dataclass
class Setup:
    """Everything checked and loaded; nothing written yet."""

    args: GenerateArgs
    target: object  # LoadedModel
    target_dir: Path
    drafter_name: str
    drafter_dir: Path | None
    drafter_model: object | None
    prompts: list[Prompt]
    sampling: object
    eos: int | None


def prepare(a: GenerateArgs, out: Path | None, log=None) -> Setup:
    from rlsched.executor.engine import check_policy
    from rlsched.executor.loading import load_model

    _check_numbers(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    sampling = _sampling(a)
    target_dir = resolve_model_dir(a.model, "target", log)
    target = load_model(target_dir, device=a.device, dtype=a.dtype)
    if target.tokenizer is None:
        raise UserError(f"model folder {target_dir} has no tokenizer.json, needed to encode the prompts")
    drafter_model, drafter_dir, name = None, None, a.drafter
    if a.drafter not in ("off", "ngram"):
        drafter_dir = resolve_model_dir(a.drafter, "drafter", log)
        drafter_model = load_model(drafter_dir, device=a.device, dtype=a.dtype)
        check_drafter_vocab(target, drafter_model, target_dir, drafter_dir)
        name = "model"
    prompts = load_prompts(a.prompts, target.tokenizer)
    if a.compile:  # after every check: compiling takes a while
        from rlsched.executor.compiled import compile_for_engine

        compile_for_engine(target.model, [] if drafter_model is None else [drafter_model.model], a.k_max,
                           a.max_batch, log)
    check_policy(a.policy, _drafter_names(name), k_max=a.k_max)  # before the auto profile prices it
    if out is not None:
        prepare_out(out)
    eos = None if a.ignore_eos else eos_id(target_dir)
    return Setup(a, target, target_dir, name, drafter_dir, drafter_model, prompts, sampling, eos)


def _drafter_names(drafter_name: str) -> tuple[str, ...]:
    return () if drafter_name == "off" else (drafter_name,)


def make_drafter(s: Setup, max_len: int, generator: torch.Generator):
    from rlsched.executor.drafters import ModelDrafter, NgramDrafter

    if s.drafter_name == "off":
        return None
    if s.drafter_name == "ngram":
        return NgramDrafter()
    return ModelDrafter(s.drafter_model.model, s.sampling, s.args.max_batch, max_len, generator)


def cost_model(s: Setup, drafter, typical_ctx: int, log=None):
    """The executor's own step costs: a `rlsched profile` folder, or a short profile now
    (for a priced policy, or for pricing migrations between instances)."""
    from rlsched.executor.engine import policy_needs_cost
    from rlsched.costs.measured import MeasuredCostModel

    a = s.args
    if not policy_needs_cost(a.policy) and not (a.instances > 1 and a.realloc != "none"):
        return None
    if a.cost_model != "auto":
        from rlsched.traces.reader import read_trace

        return MeasuredCostModel(read_trace(Path(a.cost_model) / "traces", "steps"))
    from rlsched.executor.profiler import policy_profile

    return MeasuredCostModel(policy_profile(s.target.model, drafter, policy=a.policy, max_batch=a.max_batch,
                                            k_max=a.k_max, typical_ctx=typical_ctx, sampling=s.sampling,
                                            seed=a.seed, log=log))


def _pool(s: Setup, policy, cost, budget: int, drafter_len: int, out: Path, log):
    """--instances N: N engines as Ray actors (each with --max-batch rows and the KV budget)."""
    import os

    from rlsched.executor.pool import InstancePool, InstanceSpec

    a = s.args
    threads = a.threads or max(1, (os.cpu_count() or 1) // a.instances)
    spec = InstanceSpec(str(s.target_dir), s.drafter_name, None if s.drafter_dir is None else str(s.drafter_dir),
                        s.sampling, policy, budget, a.max_batch, a.k_max, drafter_len, str(out / "traces"),
                        a.device, a.dtype, threads)
    return InstancePool(a.instances, spec, realloc=a.realloc, cost=cost, seed=a.seed, log=log)


def run(s: Setup, out: Path, log=None) -> dict:
    """Generate every prompt `n` times with the engine; write the folder; return the summary."""
    from rlsched.executor.engine import Request, RolloutEngine, build_policy, check_requests
    from rlsched.tasks.synthetic import exact_match
    from rlsched.atomic import write_text_atomic
    from rlsched.traces.writer import write_table

    a = s.args
    requests = [Request(p.ids, p.index, p.index * a.n + j, a.max_tokens, s.eos)
                for p in s.prompts for j in range(a.n)]
    longest = max(len(r.prompt) for r in requests) + a.max_tokens
    budget = a.kv_budget or a.max_batch * longest
    check_requests(requests, budget)
    gen = torch.Generator(device=a.device).manual_seed(a.seed)
    torch.manual_seed(a.seed)
    from rlsched.executor.drafters import drafter_cache_len

    drafter = make_drafter(s, drafter_cache_len(max(len(r.prompt) for r in requests), a.max_tokens, a.k_max), gen)
    typical = int(sum(len(r.prompt) for r in requests) / len(requests) + a.max_tokens / 2)
    cost = cost_model(s, drafter, typical, log)
    policy = build_policy(a.policy, _drafter_names(s.drafter_name), cost,
                          k_max=a.k_max, max_batch=a.max_batch, typical_ctx=typical)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if a.instances > 1:
        engine = _pool(s, policy, cost, budget, drafter_cache_len(max(len(r.prompt) for r in requests),
                                                                  a.max_tokens, a.k_max), out, log)
    else:
        engine = RolloutEngine(s.target.model, drafter, budget, a.max_batch, s.sampling, policy,
                               trace_dir=out / "traces", k_max=a.k_max, generator=gen)
    freeze_long_lived()
    try:
        result = engine.run(requests)
    finally:
        engine.close()
    tok = s.target.tokenizer
    rows = []
    for r, sample in zip(requests, result.samples):
        p = s.prompts[r.prompt_id]
        text = tok.decode(sample.tokens, skip_special_tokens=True)
        rows.append(dict(prompt_id=p.index, prompt_key=p.key, sample_id=r.sample_id, prompt=p.text,
                         token_ids=sample.tokens, text=text, logprobs=sample.logprobs,
                         response_len=len(sample.tokens), finish_s=sample.finish_s,
                         mean_accept_len=sample.mean_accept_len,
                         correct=None if p.answer is None else exact_match(text, p.answer)))
    df = pd.DataFrame(rows)
    write_table(out / "samples.parquet", pa.Table.from_pandas(df, preserve_index=False))
    stats = result.stats
    summary = dict(stats, model=str(s.target_dir), drafter=s.drafter_name, instances=a.instances, realloc=a.realloc,
                   drafter_dir=None if s.drafter_dir is None else str(s.drafter_dir), policy=a.policy,
                   prompts=len(s.prompts), kv_budget_tokens=budget,
                   accuracy=None if df["correct"].isna().all() else float(df["correct"].mean()),
                   args={k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(a).items()},
                   machine=platform.node(), threads=torch.get_num_threads(),
                   created_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), out=str(out))
    write_text_atomic(out / MARKER, json.dumps(summary, indent=2) + "\n")
    return summary
