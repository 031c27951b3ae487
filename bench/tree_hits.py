"""The built-in drafter's top-r hit rates against its target, and the tree model fitted to them.

The tree model (`rlsched/policies/tree.py`) says that at every depth the target's next token
is the drafter's candidate of rank r with probability p_r, p_1 = a and each further candidate
catching the share `gain` of what the ones before it missed: the top-r hit rate is
h_r = 1 - (1 - a)(1 - gain)^(r - 1). This script measures h_r on the built-in pair and fits
(a, gain) (`AcceptanceSpec.tree_gain`) to it.

Method. The built-in target samples responses (temperature 1, plain decoding through
`speculative.generate`, cut after the first end-of-sequence token) to the built-in task's
prompts (`make_examples(n, seed=12345)`, whose first 32 are the prompts `rlsched generate`
uses without a prompts file). Then both models read prompt + response in one forward each, and
at every generated position:

- rank: the rank of the target's sampled token in the drafter's distribution q at the same
  context (1 = the drafter's argmax; ties go to the sampled token);
- h_r measured: the fraction of positions with rank <= r, r = 1..16;
- h_r expected: the mean of sum of p over the drafter's top r tokens, the same quantity
  averaged over the target's distribution p instead of its one sample (less noisy);
- overlap: sum_x min(p(x), q(x)), the probability that a chain's draft sampled from q is
  accepted by lossless speculative sampling.

Which `a`. A chain's acceptance under lossless speculative sampling is the overlap, not the
top-1 hit rate: its draft is a sample of q, accepted with probability min(1, p / q). A tree's
candidates are the drafter's top tokens, not samples. Verified by matching the target's
sampled token against them, or by speculative sampling with one-hot drafts (each candidate
tried in turn against the residual of p, as SGLang's target-only tree sampling does, which
emits candidate r with probability p(c_r)), the walk takes the rank-1 child with probability
p(argmax q): the top-1 hit rate. So the tree model's p_1, and the `a` fitted here, is h_1; the
overlap is reported beside it because the simulator's `AcceptanceSpec.mean` is a chain's
acceptance, and the two part where the models are unsure: where p and q both spread over ten
digits the overlap is high and h_1 low. `a` and `gain` are fitted together by least squares on
h_1..h_8 (measured), and `gain` alone with a = h_1; r = 9..16 show how the fit extrapolates.
The fit of each task (count, add, sort, rev, repeat) shows how much `gain` varies with the
text, and a bootstrap over responses gives the spread of the fitted gain.

Run: python bench/tree_hits.py [--prompts 400] [--max-new 48] (--smoke: tiny sizes).
Results: bench/results/tree_hits.{json,txt} (or $OUT/tree_hits.* when OUT is set).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import least_squares

sys.path.insert(0, str(Path(__file__).parent))
from _common import table, write_result  # noqa: E402

from rlsched.executor.decode.sampling import SamplingParams, probs  # noqa: E402
from rlsched.executor.decode.speculative import generate  # noqa: E402
from rlsched.executor.model.builtin import EOS, builtin_pair, encode  # noqa: E402
from rlsched.executor.model.loading import load_model  # noqa: E402
from rlsched.policies.tree import rank_probs  # noqa: E402
from rlsched.tasks.synthetic import make_examples  # noqa: E402

R_MAX = 16  # hit rates reported for r = 1..R_MAX
R_FIT = 8  # fitted on r = 1..R_FIT
PROMPT_SEED = 12345  # the built-in task's prompts (executor/prompts.py)


def tree_hits(a: float, gain: float, r_max: int) -> np.ndarray:
    """The tree model's top-r hit rates h_1..h_r_max: the cumulated rank probabilities of
    `policies.tree.rank_probs`, 1 - (1 - a)(1 - gain)^(r - 1)."""
    return np.cumsum(rank_probs(a, gain, r_max))


def fit_tree(h, a: float | None = None) -> dict:
    """(a, gain) of the tree model by least squares on h = (h_1, h_2, ...); with `a` given
    only gain is fitted. Returns a, gain and the root-mean-square and largest errors."""
    h = np.asarray(h, dtype=float)
    r = len(h)
    if a is None:
        res = least_squares(lambda x: tree_hits(x[0], x[1], r) - h, [h[0], 0.25], bounds=([0.0, 1e-6], [1.0, 1 - 1e-6]))
        a, gain = res.x
    else:
        res = least_squares(lambda x: tree_hits(a, x[0], r) - h, [0.25], bounds=([1e-6], [1 - 1e-6]))
        gain = res.x[0]
    err = tree_hits(a, gain, r) - h
    return dict(a=float(a), gain=float(gain), rmse=float(np.sqrt(np.mean(err**2))), max_err=float(np.abs(err).max()))


@torch.inference_mode()
def position_stats(target, drafter, prompts: list[list[int]], responses: list[list[int]]) -> dict:
    """Per generated position: the sampled token's rank in the drafter's distribution, the
    target's mass on the drafter's top R_MAX tokens (cumulative) and the overlap of p and q.
    One forward of each model over the rows, right-padded."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    ids = torch.zeros((len(seqs), max(map(len, seqs))), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    rows = torch.tensor([i for i, r in enumerate(responses) for _ in r], dtype=torch.long)
    at = torch.tensor([len(p) - 1 + j for p, r in zip(prompts, responses) for j in range(len(r))], dtype=torch.long)
    token = ids[rows, at + 1]
    p = probs(target(ids)[rows, at])
    q = probs(drafter(ids)[rows, at])
    rank = 1 + (q > q.gather(-1, token[:, None])).sum(-1)
    top = q.argsort(-1, descending=True)[:, :R_MAX]
    mass = p.gather(-1, top).cumsum(-1)
    return dict(rank=rank.numpy(), mass=mass.numpy(), overlap=torch.minimum(p, q).sum(-1).numpy())


def sample_responses(target, prompts: list[list[int]], max_new: int, batch: int, seed: int) -> list[list[int]]:
    """The target's responses at temperature 1, each cut after its first end-of-sequence token."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(0, len(prompts), batch):
        tokens, _, _ = generate(target, prompts[i : i + batch], max_new, SamplingParams(temperature=1.0), generator=gen)
        out += [t[: t.index(EOS) + 1] if EOS in t else t for t in tokens]
    return out


def hit_rates(rank: np.ndarray) -> np.ndarray:
    """h_r = fraction of positions with rank <= r, r = 1..R_MAX."""
    return (rank[:, None] <= np.arange(1, R_MAX + 1)).mean(0)


def bootstrap_gain(rank: np.ndarray, response: np.ndarray, n: int, seed: int) -> list[float]:
    """The fitted gain's 5th and 95th percentiles over `n` resamples of the responses."""
    hits = np.stack([np.bincount(response, rank <= r) for r in range(1, R_FIT + 1)], 1)
    count = np.bincount(response)
    rng = np.random.default_rng(seed)
    gains = []
    for _ in range(n):
        pick = rng.integers(0, len(count), len(count))
        gains.append(fit_tree(hits[pick].sum(0) / count[pick].sum())["gain"])
    return [float(g) for g in np.percentile(gains, [5, 95])]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--bootstrap", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.max_new, args.batch, args.bootstrap = 10, 8, 5, 5
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    pair = builtin_pair()
    target, drafter = load_model(pair.target).model, load_model(pair.drafter).model
    examples = make_examples(args.prompts, seed=PROMPT_SEED)
    prompts = [encode(e.prompt) for e in examples]
    responses = sample_responses(target, prompts, args.max_new, args.batch, args.seed)
    parts = [
        position_stats(target, drafter, prompts[i : i + args.batch], responses[i : i + args.batch])
        for i in range(0, len(prompts), args.batch)
    ]
    rank, mass, overlap = (np.concatenate([p[k] for p in parts]) for k in ("rank", "mass", "overlap"))
    response = np.repeat(np.arange(len(responses)), [len(r) for r in responses])
    task = np.repeat([e.task for e in examples], [len(r) for r in responses])

    h, h_exp = hit_rates(rank), mass.mean(0)
    both, gain_only = fit_tree(h[:R_FIT]), fit_tree(h[:R_FIT], a=float(h[0]))
    a, gain = both["a"], both["gain"]
    r = np.arange(1, R_MAX + 1)
    model, independent = tree_hits(a, gain, R_MAX), 1 - (1 - a) ** r
    spread = bootstrap_gain(rank, response, args.bootstrap, args.seed)
    rows = [[int(k), float(h[k - 1]), float(h_exp[k - 1]), float(model[k - 1]), float(independent[k - 1])] for k in r]
    tasks = []
    for name in sorted(set(task)):
        sel = task == name
        f = fit_tree(hit_rates(rank[sel])[:R_FIT])
        tasks.append(
            dict(
                task=name,
                positions=int(sel.sum()),
                h1=float((rank[sel] == 1).mean()),
                overlap=float(overlap[sel].mean()),
                a=f["a"],
                gain=f["gain"],
                rmse=f["rmse"],
            )
        )
    seconds = time.perf_counter() - start

    text = "\n\n".join(
        [
            f"{len(rank)} positions of {len(responses)} responses (temperature 1, at most {args.max_new} tokens), "
            f"{seconds:.0f} s",
            table(
                ["r", "measured h_r", "expected h_r", f"model (a={a:.3f}, gain={gain:.3f})", "independent 1-(1-a)^r"],
                rows,
            ),
            f"fit on r=1..{R_FIT}: a {a:.3f}, gain {gain:.3f}, rmse {both['rmse']:.4f}, max error "
            f"{both['max_err']:.4f}; r=1..{R_MAX}: rmse {np.sqrt(np.mean((model - h) ** 2)):.4f}\n"
            f"gain alone with a = h_1 = {h[0]:.3f}: gain {gain_only['gain']:.3f}, rmse {gain_only['rmse']:.4f}\n"
            f"gain 5-95% over {args.bootstrap} resamples of the responses: {spread[0]:.3f}-{spread[1]:.3f}\n"
            f"sampled chain's acceptance (mean of sum min(p, q)): {overlap.mean():.3f}; top-1 hit rate h_1: {h[0]:.3f}",
            table(
                ["task", "positions", "h_1", "overlap", "a", "gain", "rmse"],
                [
                    [t["task"], t["positions"], t["h1"], t["overlap"], t["a"], t["gain"], round(t["rmse"], 4)]
                    for t in tasks
                ],
            ),
        ]
    )
    print(text)
    payload = dict(
        args=vars(args),
        positions=int(len(rank)),
        responses=len(responses),
        seconds=seconds,
        h_measured=h.tolist(),
        h_expected=h_exp.tolist(),
        model=model.tolist(),
        independent=independent.tolist(),
        fit=both,
        fit_gain_at_h1=gain_only,
        gain_5_95=spread,
        chain_acceptance=float(overlap.mean()),
        h1=float(h[0]),
        tasks=tasks,
    )
    folder = os.environ.get("OUT")
    write_result("tree_hits", payload, text, Path(folder) if folder else None)


if __name__ == "__main__":
    main()
