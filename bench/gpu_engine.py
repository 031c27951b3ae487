"""The engine on a GPU (prepared for an H200; run through bench/gpu_engine.sh).

A random-init target of a real size (the Qwen2.5-1.5B configuration) and a small drafter
(the Qwen2.5-0.5B configuration, random too), bf16 on CUDA:
1. verify cost over B x k: ms of one speculative step (target forward over k+1 tokens per
   row, verification, sampling) at a fixed context, and its ratio to a plain decode step;
   this is the curve that says where speculation stops paying (ReSpec's gap 1);
2. plain decoding tokens/s of the rollout engine at B = 1, 16, 64, 256;
3. speculative steps: the drafter's cost per drafted token against the target's decode;
4. plain decoding with the one-token forward compiled (`compile_decode`) at the batch sizes
   of (2), against eager (a failure is recorded in the results, not raised).

Random weights make acceptance meaningless, so (3) reports costs, not end-to-end SD speed;
the break-even acceptance for each B and k follows from (1) and (3). Writes
bench/results/gpu_engine.{json,txt} (or $OUT/gpu_engine.* when OUT is set).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlsched.executor.decode.drafters import ModelDrafter  # noqa: E402
from rlsched.executor.decode.sampling import SamplingParams  # noqa: E402
from rlsched.executor.engine.rollout import RolloutEngine  # noqa: E402
from rlsched.executor.engine.rows import Request  # noqa: E402
from rlsched.executor.model.transformer import ModelConfig, Transformer  # noqa: E402
from rlsched.executor.profiler import profile, profile_cache_len  # noqa: E402

QWEN_1_5B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    qkv_bias=True,
    tie_word_embeddings=True,
    rope_theta=1e6,
    max_position_embeddings=32768,
    model_type="qwen2",
)
QWEN_0_5B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    qkv_bias=True,
    tie_word_embeddings=True,
    rope_theta=1e6,
    max_position_embeddings=32768,
    model_type="qwen2",
)


def build(cfg: dict, device, dtype) -> Transformer:
    with torch.device(device):
        m = Transformer(ModelConfig(**cfg)).to(dtype)
    m.rope.materialize(device)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.02)
    return m.eval().requires_grad_(False)


def table(headers, rows) -> str:
    cells = [list(map(str, headers))] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = ["  ".join(c.rjust(x) for c, x in zip(r, w)) for r in cells]
    out.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(out)


def plain_run(model, b: int, args, dev, sp) -> tuple[int, float]:
    """Tokens and seconds of plain decoding at batch b with the rollout engine (after a warm-up)."""
    reqs = [Request(list(range(100, 100 + args.context)), i, i, args.tokens) for i in range(b)]
    eng = RolloutEngine(
        model,
        None,
        b * (args.context + args.tokens),
        b,
        sp,
        "off",
        k_max=args.k_max,
        generator=torch.Generator(device=dev).manual_seed(0),
    )
    eng.run(reqs[: min(b, 4)])  # warm-up
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    res = eng.run(reqs)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return res.stats["tokens"], time.perf_counter() - t


def compiled_plain(target, args, dev, sp, eager: list, results: dict) -> str:
    """4. plain decoding with the one-token forward compiled for every batch size
    (`compile_decode`, inductor): tokens/s at each batch size of (2) against the eager
    engine's. A failure is recorded, not raised (the sections above keep their results)."""
    try:
        t = time.perf_counter()
        target.compile_decode(1, max(p["batch"] for p in eager))
        compile_s = time.perf_counter() - t
        rows = []
        for p in eager:
            tokens, s = plain_run(target, p["batch"], args, dev, sp)
            rows.append(
                dict(batch=p["batch"], tokens=tokens, seconds=s, tok_s=tokens / s, vs_eager=tokens / s / p["tok_s"])
            )
        target.compiled = None
    except Exception as e:  # noqa: BLE001 - the record says what failed
        results["compiled_b1"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        return f"compiled plain decoding failed: {results['compiled_b1']['error'][:300]}"
    results["compiled_plain"] = rows
    results["compiled_b1"] = {**next(r for r in rows if r["batch"] == 1), "compile_s": compile_s}
    return (
        f"plain decoding with the one-token forward compiled (compile_decode; {compile_s:.0f} s to compile)\n"
        + table(["B", "tok/s", "vs eager"], [[r["batch"], f"{r['tok_s']:,.0f}", f"{r['vs_eager']:.2f}x"] for r in rows])
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,4,16,64,128,256")
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on a CPU")
    args = ap.parse_args()
    global QWEN_1_5B, QWEN_0_5B
    if args.smoke:
        small = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, head_dim=16)
        QWEN_1_5B, QWEN_0_5B = {**QWEN_1_5B, **small}, {**QWEN_0_5B, **small, "num_layers": 1}
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    sp = SamplingParams(temperature=1.0)
    t0 = time.perf_counter()
    target, drafter = build(QWEN_1_5B, dev, dtype), build(QWEN_0_5B, dev, dtype)
    results = {
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "dtype": str(dtype),
        "context": args.context,
        "host": platform.node(),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    d = ModelDrafter(drafter, sp, max(sizes), profile_cache_len((args.context,), args.k_max))
    records = profile(
        target, {"model": d}, batch_sizes=sizes, k_max=args.k_max, contexts=(args.context,), repeats=5, sampling=sp
    )
    results["profile"] = records
    verify = {(r["batch"], r["k"]): r["verify_ms"] for r in records if r["kind"] == "verify"}
    draft = {(r["batch"], r["k"]): r["draft_ms"] for r in records if r["kind"] == "draft"}
    ks = list(range(args.k_max + 1))
    rows = [[b] + [f"{verify[b, k]:.2f}" for k in ks] + [f"{verify[b, args.k_max] / verify[b, 0]:.2f}x"] for b in sizes]
    text = [
        "verify ms by batch (rows) x k (columns), context " + str(args.context),
        table(["B"] + [f"k={k}" for k in ks] + [f"k={args.k_max}/k=0"], rows),
    ]
    rows = [[b] + [f"{draft[b, k]:.2f}" for k in ks[1:]] for b in sizes]
    text += ["draft ms (0.5B-shaped drafter) by batch x k", table(["B"] + [f"k={k}" for k in ks[1:]], rows)]
    plain = []
    for b in [s for s in sizes if s <= 256]:
        tokens, s = plain_run(target, b, args, dev, sp)
        plain.append(dict(batch=b, tokens=tokens, seconds=s, tok_s=tokens / s))
    results["plain"] = plain
    text += [
        "plain decoding with the rollout engine (prefill included)",
        table(
            ["B", "tokens", "seconds", "tok/s"],
            [[p["batch"], p["tokens"], p["seconds"], f"{p['tok_s']:,.0f}"] for p in plain],
        ),
    ]
    eager = list(plain)
    if not any(p["batch"] == 1 for p in plain):
        tokens, s = plain_run(target, 1, args, dev, sp)
        eager.insert(0, dict(batch=1, tokens=tokens, seconds=s, tok_s=tokens / s))
    text.append(compiled_plain(target, args, dev, sp, eager, results))
    results["seconds"] = time.perf_counter() - t0
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_engine.json").write_text(json.dumps(results, indent=2))
    (out / "gpu_engine.txt").write_text("\n\n".join(text) + "\n")
    print("\n\n".join(text))
    print(f"\nwritten to {out} in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
