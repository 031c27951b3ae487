"""Every drafting policy on the shipped presets, side by side on the same seeds.

For each preset: a table policy is learned (`rlsched learn`), then off, static k, goodput,
seqgoodput, twostate, bandit, the learned table and the oracle are compared on 3 seeds the
table was not learned on. Ratios per seed: against off, against the best static setting chosen
after the fact (a static k, or on presets that draft trees also a fixed tree), and against the
oracle (its time over the policy's: at most 1 where the oracle is a bound). The checks list
every preset and seed that misses them. The uneven-load preset is also run with and without
reallocation.

Usage: python bench/policies.py [--seeds N] [--workers N] [--presets a,b] [--engine vllm]
    [--tables learn|reuse] [--set KEY=VALUE ...]
(`--engine vllm`: every run under the model of vLLM V1's scheduler, `engine.kind=vllm`, results
in policies_vllm and policy-PRESET_vllm.json; `--tables reuse` takes the table learned under
rlsched's engine, policy-PRESET.json, instead of learning one; other `--set` overrides need
`--name`.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _common import RESULTS, table, write_result

from rlsched.config import load_config
from rlsched.policies.policyfile import load_policy_file, save_policy_file
from rlsched.sim import compare as cmp
from rlsched.sim.learn import Learner, parallel_evaluator
from rlsched.sim.runs import run_jobs

STATIC = "static:1,static:2,static:3,static:4,static:6"
ADAPTIVE = "goodput,seqgoodput,twostate,bandit,{table},oracle"
TREES = "tree:5:4:7,tree:5:8:31"  # fixed trees where the preset drafts trees: SGLang's default, a wide one
PRESETS = {
    "longtail-grpo": "none",
    "low-acceptance": "none",
    "uneven-load": "none,rebalance",
    "default": "none",
    "ngram-llama8b": "none",
    "eagle-h200-14b": "none",
    "respec-qwen2.5-3b": "none",
    "respec-qwen2.5-7b": "none",
    "respec-qwen2.5-14b": "none",
    "rlhfspec-llama3.1-8b-ppo": "none",
}  # every shipped rollout preset


def run_preset(name: str, realloc: str, seeds: int, workers: int, extra: list[str], suffix: str, reuse: bool) -> dict:
    cfg = load_config(name, overrides=extra)
    evaluations = 0
    if reuse:
        path = RESULTS / f"policy-{name}.json"
        pf = load_policy_file(path)
    else:
        learner = Learner(
            cfg, [0], parallel_evaluator(workers), log=lambda m: print(f"  [{name}] {m}", file=sys.stderr)
        )
        pf, _ = learner.learn("table")
        evaluations = learner.evaluations
        path = RESULTS / f"policy-{name}{suffix}.json"
        save_policy_file(path, pf)
    static = f"{STATIC},{TREES}" if cfg.speculation.width_max > 1 else STATIC
    policies = f"off,{static},{ADAPTIVE.format(table=f'table:{path}')}"
    plan = cmp.make_plan(cfg, policies, realloc, seeds, 1)
    results = run_jobs(cfg, plan.jobs(), workers)
    report = cmp.aggregate(cfg, plan, results)
    report["learned_policy"] = {
        "file": str(path.relative_to(RESULTS.parent.parent)),
        "params": pf.params,
        "evaluations": evaluations,
        "learned_here": not reuse,
    }
    return report


def rows_of(report: dict) -> list[list]:
    rows = []
    for a in report["aggregate"]:
        name = "table (learned)" if a["policy"].startswith("table:") else a["policy"]
        vs_best, vs_oracle = a["ratio_vs_best_static"], a["ratio_vs_oracle"]
        rows.append(
            [
                report["name"],
                name,
                a["realloc"],
                a["generation_s"]["mean"],
                a["speedup_vs_off"]["mean"],
                f"{a['speedup_vs_off']['min']:.3f}",
                vs_best["mean"] if vs_best else "",
                f"{vs_best['min']:.3f}" if vs_best else "",
                vs_oracle["mean"] if vs_oracle else "",
                f"{vs_oracle['max']:.4f}" if vs_oracle else "",
                a["mean_accept_len"]["mean"] if a["mean_accept_len"] else "",
            ]
        )
    return rows


def per_seed(report: dict, policy_prefix: str, key: str, realloc: str = "none") -> list[float]:
    return [r[key] for r in report["runs"] if r["policy"].startswith(policy_prefix) and r["realloc"] == realloc]


ADAPTIVE_FLOOR = {"goodput": 0.995, "seqgoodput": 0.98, "twostate": 0.98, "bandit": 0.98}  # x best static


def checks_of(reports: dict) -> dict:
    """What every preset and seed must hold: each adaptive policy at least its floor against the
    best static setting, goodput at least 0.995x plain decoding, and no policy faster than the
    oracle. Each check lists the presets and seeds that miss it."""
    out: dict = {}
    floors = {p: [] for p in ADAPTIVE_FLOOR}
    goodput_off, above_oracle = [], []
    for name, rep in reports.items():
        for r in rep["runs"]:
            where = f"{name}/{r['policy']}/{r['realloc']}/seed {r['seed']}"
            floor = ADAPTIVE_FLOOR.get(r["policy"])
            if floor is not None and r["ratio_vs_best_static"] is not None and r["ratio_vs_best_static"] < floor:
                floors[r["policy"]].append(f"{where}: {r['ratio_vs_best_static']:.3f}")
            if r["policy"] == "goodput" and r["speedup_vs_off"] < 0.995:
                goodput_off.append(f"{where}: {r['speedup_vs_off']:.3f}")
            if r["ratio_vs_oracle"] is not None and r["ratio_vs_oracle"] > 1.0 + 1e-9:  # (equal: the same steps)
                above_oracle.append(f"{where}: {r['ratio_vs_oracle']:.4f}")
    for p, misses in floors.items():
        out[f"{p}_at_least_{ADAPTIVE_FLOOR[p]}x_best_static_every_seed"] = not misses
        if misses:
            out[f"{p}_misses"] = misses
    out["goodput_at_least_0.995x_off_every_seed"] = not goodput_off
    if goodput_off:
        out["goodput_off_misses"] = goodput_off
    out["no_policy_faster_than_the_oracle"] = not above_oracle
    if above_oracle:
        out["faster_than_the_oracle"] = above_oracle
    ul = reports.get("uneven-load")
    if ul:
        g = {(r["policy"], r["realloc"], r["seed"]): r["summary"]["generation_s"] for r in ul["runs"]}
        cuts = [1 - g[("goodput", "rebalance", s)] / g[("goodput", "none", s)] for s in ul["seeds"]]
        out["uneven_rebalance_cut_per_seed"] = [round(c, 3) for c in cuts]
        out["uneven_rebalance_15pct_faster_than_none_on_average"] = sum(cuts) / len(cuts) >= 0.15
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--quick", action="store_true", help="2 seeds and the first preset only (a smoke run)")
    ap.add_argument("--engine", choices=("rlsched", "vllm"), default="rlsched", help="engine.kind")
    ap.add_argument("--tables", choices=("learn", "reuse"), default="learn", help="reuse: policy-PRESET.json as it is")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, repeatable")
    ap.add_argument("--name", help="the result file's name (default policies, policies_vllm)")
    args = ap.parse_args()
    if args.set and not args.name:
        ap.error("--set needs --name, so that the default results are kept")
    extra = [*args.set, f"engine.kind={args.engine}"]
    name = args.name or ("policies" if args.engine == "rlsched" else f"policies_{args.engine}")
    suffix = name.removeprefix("policies")
    if args.quick:
        args.seeds, args.presets = 2, "default"
    t0 = time.time()
    reports = {}
    for preset in args.presets.split(","):
        reports[preset] = run_preset(
            preset, PRESETS[preset], args.seeds, args.workers, extra, suffix, args.tables == "reuse"
        )
        print(f"  [{preset}] done ({time.time() - t0:.0f} s)", file=sys.stderr)
    rows = [row for rep in reports.values() for row in rows_of(rep)]
    head = ["preset", "policy", "realloc", "gen s (mean)", "x off", "worst", "x best static", "worst"]
    head += ["x oracle", "most"]
    text = table([*head, "accept len"], rows)
    checks = checks_of(reports)
    lines = "\n".join(
        f"{'PASS' if ok is True else 'FAIL' if ok is False else '    '}  {k}"
        + ("" if isinstance(ok, bool) else f": {ok}")
        for k, ok in checks.items()
    )
    learned = "learned on seed 0, validated on 100, 101"
    if args.tables == "reuse":
        learned = "tables learned under rlsched's engine"
    seeds = f"{learned}; compared on seeds 1..{args.seeds}; ratios per seed, then averaged"
    print(f"{text}\n{seeds}\n\n{lines}\n({time.time() - t0:.0f} s)")
    slim = {n: {k: v for k, v in r.items() if k not in ("config",)} for n, r in reports.items()}
    if args.quick:
        return 0
    path = write_result(name, {"overrides": extra, "reports": slim, "checks": checks}, f"{text}\n{seeds}\n\n{lines}")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
