"""vLLM (CPU build) plain-decoding throughput, as a peer for our engine benchmark.

Run with the separate venv made by bench/peers/setup_vllm.sh, never with the project's own:

    .venv-vllm/bin/python bench/peers/vllm_plain.py --model DIR --prompts FILE.json --max-tokens T \
        [--threads 2] [--repeats 2] [--temperature 0]

FILE.json is a JSON list of lists of prompt token ids, one list per sequence; the batch size is
the number of lists. The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, executor
"uni"), every sequence generates exactly T tokens (min_tokens=max_tokens=T, ignore_eos), one
warm-up generate call, then `repeats` timed calls on all prompts at once. Prints ONE JSON line on
stdout (best wall time of the repeats); everything else, vLLM's logging included, goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local HF model folder (config.json, safetensors)")
    p.add_argument("--prompts", required=True, help="JSON list of lists of prompt token ids")
    p.add_argument("--max-tokens", type=int, required=True, help="tokens generated per sequence")
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads (default 2)")
    p.add_argument("--repeats", type=int, default=2, help="timed generate calls (default 2)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), 1 = sampled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-gib", type=int, default=1, help="CPU KV-cache space, GiB (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument(
        "--max-model-len", type=int, default=0, help="0 = longest prompt + max-tokens (capped by the model's own limit)"
    )
    p.add_argument(
        "--compile", action="store_true", help="let vLLM torch.compile the model (default: enforce_eager, faster start)"
    )
    p.add_argument(
        "--tokenizer",
        action="store_true",
        help="load the model's tokenizer (default: skip_tokenizer_init, token ids only)",
    )
    args = p.parse_args(argv)
    if args.max_tokens < 1 or args.repeats < 1 or args.threads < 1:
        p.error("--max-tokens, --repeats and --threads must be >= 1")
    return args


def load_prompts(path: str) -> list[list[int]]:
    with open(path) as f:
        prompts = json.load(f)
    if (
        not isinstance(prompts, list)
        or not prompts
        or not all(isinstance(s, list) and s and all(isinstance(t, int) for t in s) for s in prompts)
    ):
        raise SystemExit(f"{path}: expected a non-empty JSON list of non-empty lists of token ids")
    return prompts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = load_prompts(args.prompts)

    # Keep stdout for the one result line: anything printed to fd 1 from here on (vLLM logs to
    # stdout by default, C++ extensions print too) lands on stderr instead.
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    # Must be set before vllm / torch are imported.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # only read by the mp executor; be explicit
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    # libgomp's default spin-waiting collapses throughput when any other process wants a core
    # (a 2-core box with one busy neighbour); PASSIVE keeps it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    t_import = time.perf_counter()
    import torch

    torch.set_num_threads(args.threads)  # the CPU worker disables set_num_threads later on
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import_s = time.perf_counter() - t_import

    model_limit = None
    try:
        with open(os.path.join(args.model, "config.json")) as f:
            model_limit = json.load(f).get("max_position_embeddings")
    except OSError:
        pass
    need = max(len(s) for s in prompts) + args.max_tokens
    max_model_len = args.max_model_len or (min(need, model_limit) if model_limit else need)
    if need > max_model_len:
        raise SystemExit(f"longest prompt + max-tokens = {need} > max model length {max_model_len}")

    batch = len(prompts)
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="float32",
        enforce_eager=not args.compile,
        max_num_seqs=batch,
        max_model_len=max_model_len,
        max_num_batched_tokens=max(max_model_len, 2048),
        distributed_executor_backend="uni",
        skip_tokenizer_init=not args.tokenizer,
        seed=args.seed,
        enable_prefix_caching=False,  # repeats must not reuse the prompts' cache
    )
    startup_s = time.perf_counter() - t0

    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        min_tokens=args.max_tokens,
        ignore_eos=True,
        seed=None,
        detokenize=args.tokenizer,
    )
    inputs = [TokensPrompt(prompt_token_ids=s) for s in prompts]

    def run() -> tuple[float, int]:
        t = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        dt = time.perf_counter() - t
        return dt, sum(len(o.outputs[0].token_ids) for o in outs)

    warm_s, _ = run()
    times, tokens = [], 0
    for i in range(args.repeats):
        dt, tokens = run()
        times.append(dt)
        print(f"[vllm_plain] repeat {i}: {tokens} tokens in {dt:.3f} s = {tokens / dt:.1f} tok/s", file=sys.stderr)
    if tokens != batch * args.max_tokens:
        print(f"[vllm_plain] WARNING: generated {tokens} tokens, expected {batch * args.max_tokens}", file=sys.stderr)
    best = min(times)
    result = {
        "engine": "vllm-cpu",
        "version": vllm.__version__,
        "torch": torch.__version__,
        "batch": batch,
        "max_tokens": args.max_tokens,
        "prompt_tokens": sum(len(s) for s in prompts),
        "temperature": args.temperature,
        "threads": args.threads,
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
        "enforce_eager": not args.compile,
        "tokens": tokens,
        "seconds": round(best, 6),
        "tokens_per_s": round(tokens / best, 2),
        "all_seconds": [round(t, 6) for t in times],
        "warmup_s": round(warm_s, 6),
        "startup_s": round(startup_s, 3),
        "import_s": round(import_s, 3),
    }
    result_out.write(json.dumps(result) + "\n")
    result_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
