"""The executor's drafters side by side on the built-in tasks: the 2-layer draft model, the
EAGLE-3-style head, the n-gram matcher and the suffix drafter, as chains and as trees.

Workload. GRPO-like rollouts of the built-in task prompts (`make_examples`, seed 12345): P
prompts x G samples, temperature 1, each sample stops at end-of-sequence or its budget. The
same prompts come back for `--epochs` rollouts (RL samples every prompt again each epoch), so
the n-gram and suffix drafters have the earlier epochs' samples to draft from; every figure
below is the last epoch's.

Sections:
1. `accept` (batch 8): per drafter and shape, the tokens each verify emits per row (accepted +
   1), the draft time per engine step, and the rollout's tokens/s against plain decoding
   (`off`) in the same round. Shapes: chains `static:K` and trees `tree:K:W:N` (K levels, W
   candidates a node, N nodes verified; the draft model, the EAGLE head and the suffix drafter
   propose trees, the n-gram matcher chains).
2. `speedup`: rollout speedup over plain decoding at batch 1 (one sample at a time) and over a
   draining batch (all P x G samples start together, rows leave as they finish), for each
   drafter's chain and tree; the contenders take turns in every round (this machine is shared
   and noisy), and the figure is the median over rounds of the round's ratio of tokens/s.
3. `revisit`: one prompt sampled `--revisit` times in a row at batch 8, the n-gram and suffix
   drafters remembering every earlier sample: acceptance, and draft time per step in the first
   and the last tenth of the run (flat when lookups do not scan the history).

Run: python bench/drafters.py [--quick] [--sections accept,speedup,revisit] [--rounds 3]
[--drafters eagle,...] [--device cuda]. Results: bench/results/drafters.{json,txt}
(drafters_cuda.* on a GPU, drafters_<names>.* for a `--drafters` subset; in $OUT when it is
set); `bash bench/gpu_drafters.sh` is the prepared GPU run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import table, write_result  # noqa: E402

from rlsched.executor.decode.drafters import ModelDrafter, drafter_cache_len, make_drafter  # noqa: E402
from rlsched.executor.decode.eagle import load_head  # noqa: E402
from rlsched.executor.decode.eagle_builtin import builtin_head  # noqa: E402
from rlsched.executor.decode.eagle_drafter import EagleDrafter  # noqa: E402
from rlsched.executor.decode.sampling import SamplingParams  # noqa: E402
from rlsched.executor.engine.rollout import RolloutEngine  # noqa: E402
from rlsched.executor.engine.rows import Request, reserve  # noqa: E402
from rlsched.executor.model.builtin import EOS, builtin_pair, encode  # noqa: E402
from rlsched.executor.model.loading import load_model  # noqa: E402
from rlsched.tasks.synthetic import make_examples  # noqa: E402

SAMPLING = SamplingParams(temperature=1.0)
TREE_DRAFTERS = ("model", "eagle", "suffix")  # the drafters that propose trees (n-gram drafts chains)
K_MAX = 16  # the cache's spare room a step: chain drafts or tree nodes


def requests(n_prompts: int, group: int, max_tokens: int, seed: int = 12345) -> list[Request]:
    out = []
    for p, e in enumerate(make_examples(n_prompts, seed)):
        for _ in range(group):
            out.append(Request(encode(e.prompt), p, len(out), max_tokens, EOS))
    return out


class Drafters:
    """The built-in pair's target and every drafter, each made fresh per engine (the host
    drafters' memories are per contender)."""

    def __init__(self, device: str = "cpu", dtype: str = "float32", only: tuple[str, ...] = ()):
        self.only = only
        pair = builtin_pair()
        self.device = device
        self.target = load_model(pair.target, device=device, dtype=dtype).model
        self.draft_model = load_model(pair.drafter, device=device, dtype=dtype).model
        self.head = load_head(builtin_head().folder, self.target)

    def names(self) -> list[str]:
        return [n for n in ("model", "eagle", "ngram", "suffix") if not self.only or n in self.only]

    def make(self, name: str, reqs: list[Request], max_batch: int, gen: torch.Generator):
        if name == "off":
            return None
        if name == "model":
            longest = max(len(r.prompt) for r in reqs)
            return ModelDrafter(
                self.draft_model,
                SAMPLING,
                max_batch,
                drafter_cache_len(longest, max(r.max_new_tokens for r in reqs), K_MAX),
                gen,
            )
        if name == "eagle":
            return EagleDrafter(self.head, self.target, SAMPLING, gen)
        return make_drafter(name)


def engine(d: Drafters, drafter: str, policy: str, reqs: list[Request], max_batch: int):
    gen = torch.Generator(device=d.device)
    d.target.capture = None  # (an EAGLE drafter sets it again: the other contenders' forwards keep no states)
    capacity = max_batch * (max(map(reserve, reqs)) + 8)
    eng = RolloutEngine(
        d.target,
        d.make(drafter, reqs, max_batch, gen),
        capacity,
        max_batch,
        SAMPLING,
        policy,
        k_max=K_MAX,
        generator=gen,
        probe_every=None,
    )
    return eng, gen


def shapes(quick: bool) -> list[str]:
    return ["static:4", "tree:4:2:8"] if quick else ["static:3", "static:5", "tree:4:2:8", "tree:5:3:16"]


def policy_for(shape: str, drafter: str) -> str:
    return "off" if drafter == "off" else f"{shape}:{drafter}"


def run_epochs(eng, gen, reqs: list[Request], epochs: int, seed: int) -> dict:
    """The engine's rollouts of `reqs`, `epochs` times; the last one's stats and seconds."""
    for e in range(epochs):
        gen.manual_seed(seed * 1000 + e)
        t = time.perf_counter()
        res = eng.run(reqs)
        seconds = time.perf_counter() - t
    return {**res.stats, "seconds": seconds}


def contenders(d: Drafters, quick: bool) -> list[tuple[str, str]]:
    return [("off", "off")] + [
        (name, shape)
        for name in d.names()
        for shape in shapes(quick)
        if shape.startswith("static") or name in TREE_DRAFTERS
    ]


def rounds(d: Drafters, reqs, max_batch: int, epochs: int, n_rounds: int, quick: bool) -> dict:
    """Every contender's last-epoch stats in each round, the contenders in a shuffled order
    every round."""
    runs = {c: [] for c in contenders(d, quick)}
    rng = np.random.default_rng(0)
    names = list(runs)
    for r in range(n_rounds):
        for j in rng.permutation(len(names)):
            drafter, shape = names[j]
            eng, gen = engine(d, drafter, policy_for(shape, drafter), reqs, max_batch)
            runs[names[j]].append(run_epochs(eng, gen, reqs, epochs, seed=r))
    return runs


def summarise(runs: dict) -> list[dict]:
    off = runs[("off", "off")]
    rows = []
    for (drafter, shape), rs in runs.items():
        ratio = [x["tokens_per_s"] / o["tokens_per_s"] for o, x in zip(off, rs)]  # (samples end at eos: tokens vary)
        rows.append(
            dict(
                drafter=drafter,
                shape=shape if drafter != "off" else "-",
                emitted_per_verify=float(np.mean([x["mean_accept_len"] for x in rs])),
                draft_ms_per_step=float(np.mean([1e3 * x.get("draft_s", 0.0) / max(1, x["steps"]) for x in rs])),
                tokens_per_s=float(np.median([x["tokens_per_s"] for x in rs])),
                speedup=float(np.median(ratio)),
            )
        )
    return rows


def accept_section(d: Drafters, args) -> tuple[list[dict], str]:
    reqs = requests(args.prompts, args.group, args.max_tokens)
    rows = summarise(rounds(d, reqs, 8, args.epochs, args.rounds, args.quick))
    text = table(
        ["drafter", "shape", "emitted/verify", "draft ms/step", "tokens/s", "speedup vs off"],
        [
            [r["drafter"], r["shape"], r["emitted_per_verify"], r["draft_ms_per_step"], r["tokens_per_s"], r["speedup"]]
            for r in rows
        ],
    )
    return rows, f"accept (batch 8, {args.prompts} prompts x {args.group}, last of {args.epochs} epochs)\n{text}"


def speedup_section(d: Drafters, args) -> tuple[dict, str]:
    out, texts = {}, []
    for label, max_batch, prompts, group in (
        ("batch 1", 1, max(2, args.prompts // 4), 2),
        ("draining batch", args.prompts * args.group, args.prompts, args.group),
    ):
        reqs = requests(prompts, group, args.max_tokens)
        rows = summarise(rounds(d, reqs, max_batch, args.epochs, args.rounds, args.quick))
        out[label] = rows
        texts.append(
            f"{label} ({prompts} prompts x {group}, max batch {max_batch})\n"
            + table(
                ["drafter", "shape", "emitted/verify", "tokens/s", "speedup vs off"],
                [[r["drafter"], r["shape"], r["emitted_per_verify"], r["tokens_per_s"], r["speedup"]] for r in rows],
            )
        )
    return out, "\n\n".join(texts)


def revisit_section(d: Drafters, args) -> tuple[list[dict], str]:
    """One prompt, `--revisit` samples, batch 8; every earlier sample remembered."""
    reqs = requests(1, args.revisit, args.max_tokens, seed=7)
    rows = []
    for name in [n for n in ("ngram", "suffix") if n in d.names()]:
        gen = torch.Generator(device=d.device).manual_seed(0)
        drafter = make_drafter(name, max_history=args.revisit)
        eng = RolloutEngine(
            d.target,
            drafter,
            8 * (max(map(reserve, reqs)) + 8),
            8,
            SAMPLING,
            f"static:4:{name}",
            k_max=K_MAX,
            generator=gen,
            probe_every=None,
        )
        draft_ms = []
        for chunk in np.array_split(np.arange(len(reqs)), 10):
            res = eng.run([reqs[i] for i in chunk])
            draft_ms.append(1e3 * res.stats["draft_s"] / max(1, res.stats["steps"]))
            last = res.stats
        rows.append(
            dict(
                drafter=name,
                emitted_per_verify_last=last["mean_accept_len"],
                draft_ms_first=draft_ms[0],
                draft_ms_last=draft_ms[-1],
            )
        )
    text = table(
        ["drafter", "emitted/verify (last tenth)", "draft ms/step (first tenth)", "(last tenth)"],
        [[r["drafter"], r["emitted_per_verify_last"], r["draft_ms_first"], r["draft_ms_last"]] for r in rows],
    )
    return rows, f"revisit (1 prompt x {args.revisit} samples, batch 8, static:4)\n{text}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="accept,speedup,revisit")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--revisit", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer shapes, prompts and rounds (a smoke run)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the models in bfloat16)")
    ap.add_argument("--drafters", default="", help="a subset, comma-separated (default: all)")
    args = ap.parse_args()
    only = tuple(n for n in args.drafters.split(",") if n)
    if args.quick:
        args.prompts, args.group, args.max_tokens, args.rounds, args.revisit = 4, 2, 24, 1, 40
    torch.set_num_threads(args.threads)
    gpu = args.device.startswith("cuda")
    d = Drafters(args.device, "bfloat16" if gpu else "float32", only)
    payload, texts = {"args": vars(args)}, []
    sections = {"accept": accept_section, "speedup": speedup_section, "revisit": revisit_section}
    for name in args.sections.split(","):
        result, text = sections[name](d, args)
        payload[name] = result
        texts.append(text)
        print(text + "\n", flush=True)
    name = ("drafters_quick" if args.quick else "drafters") + "".join(f"_{n}" for n in only) + ("_cuda" if gpu else "")
    write_result(name, payload, "\n\n".join(texts), os.environ.get("OUT") or None)


if __name__ == "__main__":
    main()
