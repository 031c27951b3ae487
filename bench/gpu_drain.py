"""The engine benchmark's drain at a real model size, where a GPU's verify cost depends on the batch.

On the built-in pair (a few MB) a GPU verifies k + 1 tokens a row at about the price of one at
every batch size: one static k is then as good as any adaptive choice, as it is on this
project's CPU for another reason (bench/engine.py's drain). The regime that adaptive drafting
is for, verification nearly free at a few rows and ~k + 1 times dearer at 64, needs a target
of a real size. A GPU machine may have no pretrained weights at hand, so acceptance is planted:

- the target is the Qwen2.5-1.5B configuration, random weights, with every attention output
  and MLP down projection zeroed: each block still computes all its matmuls and attention
  (the step costs are the real model's), but adds nothing to the residual stream, so the
  model's greedy next token is its input token, by a wide margin (tied embeddings: e_t.e_t
  against e_t.e_u of nearly orthogonal random vectors), the same in every batch shape;
- the drafter is 4 layers of the Qwen2.5-0.5B configuration, made the same way (a draft
  forward then costs ~1/7 of a target forward, as a small drafter's should: the 24-layer
  0.5B costs about what the target does in eager PyTorch, where a forward's time at a few rows
  is its kernel launches, and SD could not pay at all). It drafts the row's last
  token repeated, which the target accepts. `PlantedDrafter` puts a token the target rejects
  at a position drawn per row and step (the drafter's cache still agrees with every token the
  target keeps, so it catches up by one or two tokens a step, as in a real run). Row r accepts
  each draft with probability a_r(f) = a_r x (1 - 0.08 f^2), f the share of its budget already
  generated, a_r ~ Beta(mean 0.89, concentration 20) per request, as the built-in pair's
  per-token acceptance in bench/engine.py's drain falls slightly along an answer;
- decoding is greedy (verification by exact match). The acceptance is planted, so this
  measures what the policies make of step costs, not the drafts' quality.

64 requests, budgets lognormal (median 64, clipped 16..256) after 128-token prompts,
generated in full; the contenders (off, static k, goodput priced by a profile taken here,
goodput:drain, bandit) in lockstep, each policy against the best static k held out
(`engine.held_out_vs_best`), as in bench/engine.py.

Run on a GPU: bash bench/gpu_engine.sh planted (a few minutes). --smoke: tiny shapes on
a CPU. Results: $OUT/gpu_drain.{json,txt} (bench/results without OUT; `--shape builtin` and a CPU
add _builtin and _cpu to the name).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import machine  # noqa: E402
from engine import bootstrap_interval, held_out_vs_best, lockstep  # noqa: E402
from gpu_engine import QWEN_0_5B, QWEN_1_5B, build, table  # noqa: E402

from rlsched.costs.measured import MeasuredCostModel  # noqa: E402
from rlsched.executor.decode.drafters import ModelDrafter, drafter_cache_len  # noqa: E402
from rlsched.executor.decode.sampling import GREEDY  # noqa: E402
from rlsched.executor.engine.rollout import RolloutEngine, build_policy  # noqa: E402
from rlsched.executor.engine.rows import Request, reserve  # noqa: E402
from rlsched.executor.profiler import profile  # noqa: E402

K_MAX = 6


def echo_target(cfg: dict, device, dtype):
    """A random model whose blocks add nothing to the residual stream: it predicts its input."""
    m = build(cfg, device, dtype)
    with torch.no_grad():
        for layer in m.layers:
            layer.attn.o.weight.zero_()
            layer.mlp.down.weight.zero_()
        if m.lm_head is not None:  # untied: read out with the embedding, as a tied model does
            m.lm_head.weight.copy_(m.embed.weight)
    return m


def builtin_shapes() -> tuple[dict, dict]:
    """The built-in pair's configurations (the shapes only: the weights are the echo ones)."""
    from rlsched.executor.model.builtin import builtin_pair
    from rlsched.executor.model.loading import load_config

    pair = builtin_pair(log=print)
    return tuple(
        {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
        for c in (load_config(pair.target), load_config(pair.drafter))
    )


class PlantedDrafter:
    """An echo model drafter (its forwards run and cost what they cost) whose drafts are cut
    where each row's planted acceptance says, by a token the echo target rejects (see the
    module docstring). Everything else (its cache, catch-up, release) is the wrapped drafter's."""

    name = "model"

    def __init__(self, inner: ModelDrafter, base: dict, plan: dict, generator: torch.Generator, vocab: int):
        self.inner, self.base, self.plan, self.generator, self.vocab = inner, base, plan, generator, vocab

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def acceptance(self, rows) -> torch.Tensor:
        """Each row's planted per-token acceptance now."""
        out = []
        for s in rows:
            prompt_len, budget = self.plan.get(s.prompt_id, (len(s.tokens), 1))
            f = min(max(len(s.tokens) - prompt_len, 0) / budget, 1.0)
            out.append(self.base.get(s.prompt_id, 0.89) * (1 - 0.08 * f**2))
        return torch.tensor(out, dtype=torch.float32)

    def propose(self, rows, k):
        drafts, _, dk = self.inner.propose(rows, k)
        b = len(rows)
        if k == 0:
            return drafts, None, dk
        tokens = drafts.cpu().clone()  # the row's last token, k times (an echo drafter, greedy)
        u = torch.rand((b, k), generator=self.generator, device=self.generator.device).cpu()
        accepted = (u < self.acceptance(rows)[:, None]).long().cumprod(1).sum(1)  # before the planted rejection
        miss = torch.nonzero(accepted < k)[:, 0]
        at = accepted[miss]
        tokens[miss, at] = (tokens[miss, at] + 1) % self.vocab  # not the token the echo target predicts
        return tokens, None, dk


def requests(n: int, prompt_len: int, median: int, lo: int, hi: int, vocab: int, seed: int, first: int = 0):
    """n requests (ids from `first`) of random prompts with long-tail budgets, each one's
    planted base acceptance, and its (prompt length, budget)."""
    rng = np.random.default_rng(seed)
    budgets = np.clip(np.round(median * np.exp(0.9 * rng.standard_normal(n))), lo, hi).astype(int)
    prompts = rng.integers(10, vocab - 10, (n, prompt_len))
    base = rng.beta(0.89 * 20, 0.11 * 20, n)
    ids = range(first, first + n)
    reqs = [Request(p.tolist(), i, i, int(t)) for i, p, t in zip(ids, prompts, budgets)]
    return reqs, dict(zip(ids, map(float, base))), {i: (prompt_len, int(t)) for i, t in zip(ids, budgets)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and budgets, to check the script on a CPU")
    ap.add_argument(
        "--shape",
        choices=("qwen", "builtin"),
        default="qwen",
        help="qwen: the 1.5B target and a 4-layer 0.5B-wide drafter; builtin: the built-in pair's "
        "shapes and bench/engine.py's drain budgets (to set the planted drain beside the real one)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target_cfg, drafter_cfg = QWEN_1_5B, {**QWEN_0_5B, "num_layers": 4}
    prompt_len, median, lo, hi, n = 128, 64, 16, 256, 64
    if args.shape == "builtin":  # bench/engine.py's drain: budgets median 24 (4..120), short prompts
        target_cfg, drafter_cfg = builtin_shapes()
        prompt_len, median, lo, hi, n = 24, 24, 4, 120, 64
    if args.smoke:
        small = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, head_dim=16)
        target_cfg, drafter_cfg = {**QWEN_1_5B, **small}, {**QWEN_0_5B, **small, "num_layers": 1}
        prompt_len, median, lo, hi, n = 16, 12, 4, 40, 16
    t0 = time.perf_counter()
    target, drafter = echo_target(target_cfg, dev, dtype), echo_target(drafter_cfg, dev, dtype)
    vocab = target_cfg["vocab_size"]
    reqs, base, plan = requests(n, prompt_len, median, lo, hi, vocab, seed=21)
    warm, wbase, wplan = requests(n, prompt_len, median, lo, hi, vocab, seed=22, first=n)
    base.update(wbase)
    plan.update(wplan)
    longest = max(map(reserve, reqs + warm)) + 8
    cache_len = drafter_cache_len(prompt_len, hi, K_MAX)

    def planted(generator):
        return PlantedDrafter(ModelDrafter(drafter, GREEDY, n, cache_len, generator), base, plan, generator, vocab)

    per_row = prompt_len + median // 2
    gen = torch.Generator(device=dev).manual_seed(0)
    records = profile(
        target,
        {"model": planted(gen)},
        batch_sizes=tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= n),
        k_max=K_MAX,
        contexts=(per_row // 2, per_row * 2),
        repeats=3,
        passes=1,
        sampling=GREEDY,
    )
    cost = MeasuredCostModel(pd.DataFrame(records))
    v = cost.verify_time(n, np.array([1.0, K_MAX + 1.0]), n * per_row)
    profile_s = time.perf_counter() - t0

    adaptive = ["goodput", "goodput:unguarded", "goodput:drain", "bandit", "bandit:unguarded"]
    names = ["off"] + [f"static:{k}" for k in range(1, K_MAX + 1)] + adaptive
    engines = {}
    for name in names:
        g = torch.Generator(device=dev)
        pol = build_policy(name, ("model",), cost, k_max=K_MAX, max_batch=n)
        eng = RolloutEngine(
            target,
            None if name == "off" else planted(g),
            n * longest,
            n,
            GREEDY,
            pol,
            cost=cost,
            k_max=K_MAX,
            generator=g,
        )
        if not name.startswith(("off", "static")):
            eng.run(warm)  # their estimates and learned statistics carry over, as between RL steps
        engines[name] = (eng, g)
    _, rounds = lockstep(engines, reqs, 4 if args.smoke else args.rounds)
    statics = [x for x in names if x.startswith("static")]
    rows, out = [], []
    off_total = sum(t for t, _ in rounds["off"])
    for name in names:
        total = sum(t for t, _ in rounds[name])
        res = [r for _, r in rounds[name]]
        ho = held_out_vs_best(rounds, statics, name)
        lo90, hi90 = bootstrap_interval(
            rounds, lambda rs, name=name: held_out_vs_best(rs, statics, name), n=200 if args.smoke else 1000, block=2
        )
        entry = dict(
            policy=name,
            total_s=total,
            vs_off=off_total / total,
            vs_best_static_held_out=ho,
            held_out_90=[lo90, hi90],
            steps=float(np.mean([r.stats["steps"] for r in res])),
            mean_accept_len=float(np.mean([r.stats["mean_accept_len"] for r in res])),
            round_seconds=[float(t) for t, _ in rounds[name]],
        )
        out.append(entry)
        rows.append(
            [
                name,
                f"{total:.2f}",
                f"{entry['vs_off']:.3f}x",
                f"{ho:.3f}x",
                f"{lo90:.3f}-{hi90:.3f}",
                f"{entry['steps']:.0f}",
                f"{entry['mean_accept_len']:.2f}",
            ]
        )
    lens = np.array([r.max_new_tokens for r in reqs])
    text = (
        f"planted-acceptance drain on {args.device} ({dtype}): echo target {target_cfg['hidden_size']}x"
        f"{target_cfg['num_layers']}, drafter {drafter_cfg['hidden_size']}x{drafter_cfg['num_layers']}; "
        f"{n} requests, budgets median {np.median(lens):.0f}, max {lens.max()}; "
        f"{len(rounds['off'])} rounds in lockstep; "
        f"a verify of {K_MAX + 1} tokens a row at {n} rows costs {v[1] / v[0]:.2f}x one token's (this profile, "
        f"{profile_s:.0f} s with the models' set-up)\n"
        + table(
            ["policy", "all rounds s", "vs off", "vs best static (held out)", "held out, 90%", "steps", "mean acc len"],
            rows,
        )
    )
    results = dict(
        machine=machine(),
        shape=args.shape,
        device=torch.cuda.get_device_name(0) if dev.type == "cuda" else platform.processor(),
        torch=torch.__version__,
        dtype=str(dtype),
        smoke=args.smoke,
        host=platform.node(),
        utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        budgets=lens.tolist(),
        verify_q7_over_q1=float(v[1] / v[0]),
        rows=out,
        seconds=time.perf_counter() - t0,
    )
    where = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    where.mkdir(parents=True, exist_ok=True)
    name = (
        "gpu_drain"
        + ("" if args.shape == "qwen" else f"_{args.shape}")
        + ("" if dev.type == "cuda" else f"_{dev.type}")
    )
    (where / f"{name}.json").write_text(json.dumps(results, indent=2))
    (where / f"{name}.txt").write_text(f"{results['machine']}\n\n{text}\n")
    print(text)
    print(f"\nwritten to {where} in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
