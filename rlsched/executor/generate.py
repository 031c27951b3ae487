"""`rlsched generate`: batched speculative rollouts from a prompts file, written to a folder.

Everything the user gives is checked before anything is written (the policy and its cost model
folder first, before any model is loaded; then model and drafter folders, vocabularies, prompts,
sampling), so bad input leaves no folder behind. Then `out` is locked (`rlsched.locks`: one
command at a time per folder) before it is looked at, and held until the run ends. The run then
writes, under `out/`:

- `traces/steps/`, `traces/samples/`: the engine's trace parts, journaled every record (a run
  killed mid-way keeps every completed step readable);
- `samples.parquet`: per sample the prompt id, the token ids, the text and the per-token
  target log-probs (what an RL update needs);
- `summary.json`: tokens/s, mean accepted length and the run's settings.

A write that fails for want of room or permission removes the folder and ends the command in
one line naming the file.
"""

from __future__ import annotations

import os
import platform
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
import torch

from rlsched.errors import UserError
from rlsched.executor.backends import BackendConfig, make_backend
from rlsched.executor.folders import WriteFailed, prepare_out, remove_leftovers, writing
from rlsched.executor.gcfreeze import freeze_long_lived
from rlsched.executor.prompts import Prompt, load_prompts
from rlsched.executor.setup import (
    Models,
    check_cost_folder,
    check_policy_model,
    check_width_max,
    cost_model,
    drafter_kind,
    load_models,
    make_drafter,
    needs_cost,
)
from rlsched.locks import FolderLock, hold
from rlsched.policies.drafters import drafter_names
from rlsched.policies.registry import GENERATE, PolicySpec, parse_policy

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
    width_max: int = 1  # widest draft tree a priced policy may choose (1: chains only)
    max_batch: int = 64
    kv_budget: int | None = None  # tokens; default: every running row at its longest
    cost_model: str = "auto"  # auto (profile at start), or a `rlsched profile` folder
    ignore_eos: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    threads: int | None = None
    instances: int = 1  # more than 1: a Ray pool (rlsched.executor.pool.instances)
    realloc: str = "none"  # the pool's ReallocPolicy
    compile: bool = False  # decode and verify forwards through compiled graphs (executor/model/compiled.py)


# --- checking inputs -------------------------------------------------------------------------


def _sampling(a: GenerateArgs):
    from rlsched.executor.decode.sampling import SamplingParams

    try:
        return SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p)
    except ValueError as e:
        raise UserError(f"sampling: {e}") from None


def _check_numbers(a: GenerateArgs) -> None:
    for name, v, lo in (
        ("n", a.n, 1),
        ("max_tokens", a.max_tokens, 1),
        ("max_batch", a.max_batch, 1),
        ("k_max", a.k_max, 1),
    ):
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
        from rlsched.executor.pool.instances import require_ray

        require_ray()


# --- the run ---------------------------------------------------------------------------------


@dataclass
class Setup:
    """Everything checked and loaded, the out folder locked; nothing written to it yet."""

    args: GenerateArgs
    policy: PolicySpec  # --policy, parsed
    models: Models
    prompts: list[Prompt]
    sampling: object
    eos: int | None
    lock: FolderLock | None = None  # on the out folder, from `prepare` to the end of `run`

    @property
    def drafter_name(self) -> str:
        return self.models.drafter_name


def prepare(a: GenerateArgs, out: Path | None, log=None) -> Setup:
    _check_numbers(a)
    # the policy and its cost model folder first: the drafter's kind is known from --drafter alone
    policy = parse_policy(a.policy, "local").check(drafter_names(drafter_kind(a.drafter)), a.k_max, GENERATE)
    check_width_max(a.width_max, drafter_kind(a.drafter), "local", "--width-max")
    if needs_cost(policy, a.instances, a.realloc):
        check_cost_folder(a.cost_model, "--cost-model")
    if a.threads:
        torch.set_num_threads(a.threads)
    sampling = _sampling(a)
    m = load_models(a.model, a.drafter, device=a.device, dtype=a.dtype, log=log)
    check_policy_model(policy, m.target_dir, m.target.config)
    prompts = load_prompts(a.prompts, m.tokenizer)
    lock = None if out is None else _lock_out(out)
    try:
        if a.compile:  # after every check: compiling takes a while
            from rlsched.executor.model.compiled import compile_for_engine

            compile_for_engine(
                m.target, [] if m.drafter_model is None else [m.drafter_model], a.k_max, a.max_batch, log
            )
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Setup(a, policy, m, prompts, sampling, None if a.ignore_eos else m.eos, lock)


def _lock_out(out: Path) -> FolderLock:
    """Lock `out`, then check it and clear what killed writes left beside it."""
    lock = hold(out, "generate")
    try:
        prepare_out(out)
        remove_leftovers(out, siblings=True)
    except BaseException:
        lock.release()
        raise
    return lock


def run(s: Setup, out: Path, log=None) -> dict:
    """Generate every prompt `n` times with the engine; write the folder; return the summary.
    The lock `prepare` took is given back at the end."""
    try:
        with writing(out):
            return _generate(s, out, log)
    except WriteFailed as e:
        shutil.rmtree(out, ignore_errors=True)
        raise UserError(
            f"writing {e.path} failed ({e.reason}); {out} was removed: {e.fix}, then generate again"
        ) from None
    finally:
        if s.lock is not None:
            s.lock.release()


def _generate(s: Setup, out: Path, log) -> dict:
    from rlsched.atomic import json_text, write_text_atomic
    from rlsched.executor.engine.rows import Request, check_requests
    from rlsched.traces.writer import write_table

    a = s.args
    requests = [Request(p.ids, p.index, p.index * a.n + j, a.max_tokens, s.eos) for p in s.prompts for j in range(a.n)]
    longest = max(len(r.prompt) for r in requests)
    budget = a.kv_budget or a.max_batch * (longest + a.max_tokens)
    check_requests(requests, budget)
    engine = _start(s, requests, longest, budget, out, log)
    freeze_long_lived()
    try:
        result = engine.run(requests)
    finally:
        engine.close()
    df = _samples_frame(s, requests, result.samples)
    write_table(out / "samples.parquet", pa.Table.from_pandas(df, preserve_index=False))
    summary = _summary(s, result.stats, df, budget, out)
    write_text_atomic(out / MARKER, json_text(summary) + "\n")
    return summary


def _start(s: Setup, requests, longest: int, budget: int, out: Path, log):
    """The drafter, the cost model and the policy, then a fresh `out` and the engine (in this
    process or a pool) over a KV budget of `budget` tokens."""
    from rlsched.executor.decode.drafters import drafter_cache_len
    from rlsched.executor.engine.rollout import build_policy

    a, m = s.args, s.models
    gen = torch.Generator(device=a.device).manual_seed(a.seed)
    torch.manual_seed(a.seed)
    drafter_len = drafter_cache_len(longest, a.max_tokens, a.k_max)
    drafter = make_drafter(m, s.sampling, a.max_batch, drafter_len, gen)
    typical = int(sum(len(r.prompt) for r in requests) / len(requests) + a.max_tokens / 2)
    cost, _ = cost_model(
        s.policy,
        a.cost_model,
        m.target,
        drafter,
        s.sampling,
        instances=a.instances,
        realloc=a.realloc,
        max_batch=a.max_batch,
        k_max=a.k_max,
        typical_ctx=typical,
        seed=a.seed,
        log=log,
        width_max=a.width_max,
    )
    policy = build_policy(
        s.policy,
        m.drafter_names,
        cost,
        GENERATE,
        k_max=a.k_max,
        max_batch=a.max_batch,
        typical_ctx=typical,
        width_max=a.width_max,
        nodes_max=a.k_max,
    )
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    # --threads is per instance; a pool shares the cores by default
    threads = a.threads or max(1, (os.cpu_count() or 1) // a.instances)
    config = BackendConfig(
        "local",
        a.instances,
        s.policy,
        budget,
        a.max_batch,
        a.k_max,
        drafter_len,
        out / "traces",
        a.device,
        a.dtype,
        threads,
        realloc=a.realloc,
        seed=a.seed,
    )
    return make_backend(config, m, drafter, s.sampling, policy, cost=cost, generator=gen, log=log)


def _samples_frame(s: Setup, requests, samples) -> pd.DataFrame:
    """One row a sample: its prompt, tokens, text, log-probs and whether it is right."""
    from rlsched.tasks.synthetic import exact_match

    tok = s.models.tokenizer
    rows = []
    for r, sample in zip(requests, samples):
        p = s.prompts[r.prompt_id]
        text = tok.decode(sample.tokens, skip_special_tokens=True)
        rows.append(
            dict(
                prompt_id=p.index,
                prompt_key=p.key,
                sample_id=r.sample_id,
                prompt=p.text,
                token_ids=sample.tokens,
                text=text,
                logprobs=sample.logprobs,
                response_len=len(sample.tokens),
                finish_s=sample.finish_s,
                mean_accept_len=sample.mean_accept_len,
                correct=None if p.answer is None else exact_match(text, p.answer),
            )
        )
    return pd.DataFrame(rows)


def _summary(s: Setup, stats: dict, df: pd.DataFrame, budget: int, out: Path) -> dict:
    a, m = s.args, s.models
    return dict(
        stats,
        model=str(m.target_dir),
        drafter=m.drafter_name,
        instances=a.instances,
        realloc=a.realloc,
        drafter_dir=None if m.drafter_dir is None else str(m.drafter_dir),
        policy=a.policy,
        prompts=len(s.prompts),
        kv_budget_tokens=budget,
        accuracy=None if df["correct"].isna().all() else float(df["correct"].mean()),
        args={k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(a).items()},
        machine=platform.node(),
        threads=torch.get_num_threads(),
        created_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        out=str(out),
    )
