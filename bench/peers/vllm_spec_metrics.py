"""Run vLLM's CPU build with speculative decoding and record its metrics after every generate call.

Run with the separate venv made by bench/peers/setup_vllm.sh, never with the project's own:

    .venv-vllm/bin/python bench/peers/vllm_spec_metrics.py --target DIR --drafter DIR --out METRICS.json \
        [--prom METRICS.prom] [--method draft_model|ngram] [--batches 1,4,16,64] [--ks 0,2,4] \
        [--max-tokens 32] [--threads 2] [--temperature 0] [--ignore-eos]
    .venv/bin/rlsched import-vllm METRICS.json --out DIR      # step traces that `rlsched fit DIR` reads

For every k of --ks one engine is made (k = 0: plain decoding, no speculative_config; k > 0:
`method` with `num_speculative_tokens = k`, `--drafter` as the draft model for draft_model),
then one small warm-up generate, then one generate per batch size of --batches (that many
prompts of the built-in synthetic tasks, all submitted at once, max_num_seqs = the largest
batch, a token budget that prefills them all in one step). `LLM.get_metrics()` is taken right
after the engine starts, after the warm-up and after every generate call, with the wall time:
one snapshot each, in order. vLLM's counters restart with every engine, so each engine's
snapshots form one `run`; the first two (start, warm-up) are marked `"record": false` (they
are baselines, not measured intervals).

METRICS.json (the format `rlsched import-vllm` reads, documented in rlsched/traces/vllm_snapshots.py):

    {"format": "rlsched-vllm-metrics", "version": 1, "vllm": "0.32.0", "config": {...},
     "snapshots": [{"run": 0, "label": "k2-b16", "time_s": 12.3, "record": true,
                    "batch": 16, "k": 2, "drafter": "draft_model", "generate_s": 0.71,
                    "metrics": [{"name": "vllm:spec_decode_num_drafts", "type": "counter",
                                 "labels": {"engine": "0", "model_name": "..."}, "value": 123}, ...]}]}

metric objects are LLM.get_metrics()'s (vllm/v1/metrics/reader.py) as JSON: counter and gauge
{value}, vector {values} (accepted tokens per draft position), histogram {count, sum, buckets:
{le: cumulative count}}. --prom also writes the same snapshots as Prometheus text (what
/metrics serves: `prometheus_client.generate_latest`), each scrape after a comment line
`# rlsched-snapshot {JSON of the snapshot's other fields}`. --only-imported keeps only the metrics
`rlsched import-vllm` reads (small files: the test fixtures tests/data/vllm_metrics.* were made so);
--served-name sets the metrics' model_name label.

CPU workarounds (see /work/shared/REFERENCES.md): in-process engine
(VLLM_ENABLE_V1_MULTIPROCESSING=0, distributed_executor_backend="uni"), OMP_WAIT_POLICY=PASSIVE,
enforce_eager, and https://github.com/vllm-project/vllm/issues/55005: the CPU shim of
rejection_sampler.expand_batch_to_tokens
drops its output, which breaks sampled (temperature > 0) speculative decoding; it is replaced
here by a torch repeat_interleave version (greedy decoding never calls it). Everything vLLM
prints goes to stderr; stdout gets one JSON line (what was written, acceptance per position).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORMAT, VERSION = "rlsched-vllm-metrics", 1
# the metrics `rlsched import-vllm` reads (rlsched/traces/vllm_snapshots.py: NEEDED); --only-imported keeps these
IMPORTED = (
    "vllm:generation_tokens",
    "vllm:inter_token_latency_seconds",
    "vllm:iteration_tokens_total",
    "vllm:num_preemptions",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:prompt_tokens",
    "vllm:request_prefill_time_seconds",
    "vllm:request_success",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_drafts",
    "vllm:time_to_first_token_seconds",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target model: a local HF folder")
    p.add_argument("--drafter", default=None, help="draft model folder (needed for --method draft_model)")
    p.add_argument(
        "--method",
        default="draft_model",
        choices=("draft_model", "ngram"),
        help="vLLM speculative method (default draft_model)",
    )
    p.add_argument("--out", required=True, help="where to write the snapshots (.json)")
    p.add_argument("--prom", default=None, help="also write them as Prometheus text (.prom)")
    p.add_argument("--batches", default="1,4,16,64", help="batch sizes, one generate call each (default 1,4,16,64)")
    p.add_argument("--ks", default="0,2,4", help="draft lengths, one engine each; 0 = plain decoding (default 0,2,4)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per sequence at most (default 32)")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every sequence generates exactly --max-tokens (constant batch; past the answer the "
        "built-in pair writes text it was never trained on)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads (default 2)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of vLLM")
    p.add_argument("--kv-gib", type=int, default=1, help="CPU KV-cache space, GiB (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--served-name", default="target", help="model_name label of the metrics (default target)")
    p.add_argument(
        "--only-imported",
        action="store_true",
        help="keep only the metrics `rlsched import-vllm` reads (small files, e.g. test fixtures)",
    )
    args = p.parse_args(argv)
    try:
        args.batches = [int(x) for x in args.batches.split(",") if x.strip()]
        args.ks = [int(x) for x in args.ks.split(",") if x.strip()]
    except ValueError:
        p.error("--batches and --ks are comma-separated integers")
    if not args.batches or min(args.batches) < 1 or not args.ks or min(args.ks) < 0:
        p.error("--batches must be >= 1 and --ks >= 0")
    if args.max_tokens < 1 or args.threads < 1:
        p.error("--max-tokens and --threads must be >= 1")
    if args.method == "draft_model" and any(args.ks) and not args.drafter:
        p.error("--method draft_model needs --drafter DIR")
    return args


def task_prompts(n: int, seed: int, model_dir: str) -> list[list[int]]:
    """`n` prompts of the built-in synthetic tasks as token ids of the model's character
    tokenizer (tokenizer.json's vocabulary; one token per character)."""
    sys.path.insert(0, str(ROOT))
    from rlsched.tasks.synthetic import make_examples  # numpy only

    vocab = json.loads((Path(model_dir) / "tokenizer.json").read_text())["model"]["vocab"]
    unk = vocab.get("<unk>", 0)
    return [[vocab.get(c, unk) for c in e.prompt] for e in make_examples(n, seed)]


def patch_rejection_sampler() -> None:
    """The backend's patch of the CPU shim of expand_batch_to_tokens
    (https://github.com/vllm-project/vllm/issues/55005)."""
    sys.path.insert(0, str(ROOT))
    from rlsched.executor.vllm.shims import patch_cpu_rejection_sampler

    patch_cpu_rejection_sampler()


def prom_family(line: str) -> str:
    """The metric family a Prometheus text line is about ('' for other comments)."""
    if line.startswith("# HELP ") or line.startswith("# TYPE "):
        name = line.split()[2]
    elif line.startswith("#"):
        return ""
    else:
        name = line.split("{")[0].split()[0]
    for suffix in ("_total", "_created", "_bucket", "_count", "_sum"):
        if name.endswith(suffix) and name[: -len(suffix)] in IMPORTED:
            return name[: -len(suffix)]
    return name


def metric_json(m) -> dict:
    """One LLM.get_metrics() object (Counter, Gauge, Vector, Histogram) as JSON."""
    d = dataclasses.asdict(m)
    d["type"] = type(m).__name__.lower()
    return d


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(args.threads)
    import vllm
    from prometheus_client import REGISTRY, generate_latest
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    patch_rejection_sampler()
    prompts = task_prompts(max(args.batches), args.seed, args.target)
    limit = json.loads((Path(args.target) / "config.json").read_text()).get("max_position_embeddings", 256)
    max_model_len = min(limit, max(map(len, prompts)) + args.max_tokens + max(args.ks) + 1)
    budget = max(2048, sum(map(len, prompts)))
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        min_tokens=args.max_tokens if args.ignore_eos else 0,
        ignore_eos=args.ignore_eos,
        detokenize=False,
        seed=None,
    )
    config = {
        "target": args.target,
        "served_name": args.served_name,
        "drafter": args.drafter,
        "method": args.method,
        "batches": args.batches,
        "ks": args.ks,
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "threads": args.threads,
        "seed": args.seed,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": budget,
        "max_num_seqs": max(args.batches),
        "enforce_eager": True,
        "dtype": "float32",
        "prompts": "rlsched.tasks.synthetic.make_examples",
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
    }
    snapshots, proms = [], []

    def snap(llm, run, label, record, **extra):
        s = {"run": run, "label": label, "time_s": round(time.perf_counter() - t_start, 6), "record": record, **extra}
        text = generate_latest(REGISTRY).decode()
        metrics = [metric_json(m) for m in llm.get_metrics()]
        if args.only_imported:
            text = "".join(line + "\n" for line in text.splitlines() if prom_family(line) in IMPORTED)
            metrics = [m for m in metrics if m["name"] in IMPORTED]
        proms.append("# rlsched-snapshot " + json.dumps(s) + "\n" + text)
        s["metrics"] = metrics
        snapshots.append(s)

    for run, k in enumerate(args.ks):
        spec = None
        if k > 0:
            spec = {"method": args.method, "num_speculative_tokens": k}
            if args.method == "draft_model":
                spec["model"] = args.drafter
                spec["draft_sample_method"] = "probabilistic" if args.temperature > 0 else "greedy"
            else:
                spec.update(prompt_lookup_min=1, prompt_lookup_max=4)
        drafter = "off" if k == 0 else ("model" if args.method == "draft_model" else "ngram")
        t0 = time.perf_counter()
        llm = LLM(
            model=args.target,
            dtype="float32",
            enforce_eager=True,
            max_num_seqs=max(args.batches),
            max_model_len=max_model_len,
            max_num_batched_tokens=budget,
            distributed_executor_backend="uni",
            skip_tokenizer_init=True,
            seed=args.seed,
            enable_prefix_caching=False,
            disable_log_stats=False,
            speculative_config=spec,
            served_model_name=args.served_name,
        )
        print(f"[vllm_spec_metrics] k={k}: engine up in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        snap(llm, run, f"k{k}-start", False, k=k, drafter=drafter)
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)
        snap(llm, run, f"k{k}-warmup", False, k=k, drafter=drafter)
        for b in args.batches:
            t = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:b]], params, use_tqdm=False)
            dt = time.perf_counter() - t
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            snap(
                llm,
                run,
                f"k{k}-b{b}",
                True,
                k=k,
                drafter=drafter,
                batch=b,
                generate_s=round(dt, 6),
                tokens=tokens,
                prompt_tokens=sum(map(len, prompts[:b])),
            )
            print(f"[vllm_spec_metrics] k={k} B={b}: {tokens} tokens in {dt:.3f} s", file=sys.stderr)
        del llm
        gc.collect()

    doc = {
        "format": FORMAT,
        "version": VERSION,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config,
        "snapshots": snapshots,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    if args.prom:
        Path(args.prom).write_text("".join(proms))
    accept = {}
    for s in snapshots:
        if s["record"]:
            for m in s["metrics"]:
                if m["name"] == "vllm:spec_decode_num_accepted_tokens_per_pos":
                    drafts = sum(x["value"] for x in s["metrics"] if x["name"] == "vllm:spec_decode_num_drafts")
                    accept[f"k{s['k']}"] = [round(v / drafts, 4) for v in m["values"]] if drafts else None
    result_out.write(
        json.dumps(
            {
                "out": args.out,
                "prom": args.prom,
                "snapshots": len(snapshots),
                "seconds": round(time.perf_counter() - t_start, 2),
                "acceptance_per_position_cumulative": accept,
            }
        )
        + "\n"
    )
    result_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
