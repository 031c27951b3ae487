"""GPU cost models against measured GPU kernel timings, on models held out of the calibration.

Data: Microsoft Vidur's public per-layer profiles (data/vidur: A100 and H100, per-op medians
of one transformer layer for T = 1..4096 new tokens at TP 1-8; all-reduce times per TP degree;
decode attention for one head layout on A100). Two models of one layer are compared with it:

- roofline: a whole-forward roofline, one max of total compute and total memory over the
  layer's matmuls, no floors, at textbook efficiencies (`ROOFLINE`), per layer;
- per-op: `rlsched/costs/ops.py`, each linear group and the element-wise kernels on their own
  roofline with a floor (linears: whole GEMM tiles of tokens, a smooth memory-to-compute turn;
  element-wise: one token's row per thread block at few tokens), efficiencies, floors and
  shapes calibrated on the calibration models of the GPU (relative error, every token count
  weighted by its share of the log-token axis), then applied unchanged to the held-out ones.

Regimes (held-out models, every TP degree): decode small (T <= 16 tokens), decode large
(32 <= T <= 512), prefill (T >= 2048), layer time = linears + element-wise kernels (attention
is not in these profiles). All-reduce: latency and bus bandwidth fitted on TP 2 and 8, reported
on TP 4, at the message sizes of decode (T x hidden x 2 bytes, T <= 512). Long-context
attention: fitted on caches <= 1024 tokens, reported on caches >= 2048 (A100, the one layout
stored). For these two, the same form fitted on the reported rows themselves is shown too: how
close the data lets a latency-plus-bandwidth line or a KV-read-plus-floor come. The batch
where verifying q = 2, 4, 8 tokens per sequence costs 1.25x plain decoding (layer time at B q
over B, TP 1, B a power of two), measured against each model.

Run: python bench/gpu_costs.py. Results: bench/results/gpu_costs.{json,txt}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).parent))
from _common import table, write_result  # noqa: E402

from rlsched.config import load_preset_data  # noqa: E402
from rlsched.costs.ops import (
    OpCosts,
    Shape,
    allreduce_time,
    attention_time,
    elementwise_time,
    fit_allreduce,  # noqa: E402
    fit_attention,
    fit_op_costs,
    linear_times,
)

DATA = Path(__file__).resolve().parent.parent / "data" / "vidur"
GPUS = {"a100": "a100-80gb", "h100": "h100-sxm"}  # Vidur's GPU -> the hardware preset (peaks)
NETWORK = {"a100": "a100_dgx", "h100": "h100_dgx"}
CALIBRATE = {"Llama-2-7b-hf", "Llama-2-70b-hf", "Qwen-72B"}  # the rest of each GPU is held out
COLUMNS = {"qkv": "attn_pre_proj", "o": "attn_post_proj", "up": "mlp_up_proj", "down": "mlp_down_proj"}
ELEMENTWISE = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")
REGIMES = {"decode small": (1, 16), "decode large": (32, 512), "prefill": (2048, 4096)}
Q_RATIO = 1.25
# the whole-forward roofline's efficiencies: 0.6 of peak compute, 0.8 of peak bandwidth, an 8 us
# all-reduce at NVLink's bus bandwidth
ROOFLINE = {"compute_efficiency": 0.6, "memory_efficiency": 0.8, "allreduce_latency_us": 8.0, "nvlink_gbs": 450.0}


def read_model(path: Path) -> tuple[Shape, dict[int, pd.DataFrame]]:
    d = pd.read_csv(path)
    r = d.iloc[0]
    shape = Shape(
        int(r.n_embd),
        int(r.n_head),
        int(r.n_kv_head),
        int(r.n_embd) // int(r.n_head),
        int(r.n_expanded_embd),
        bool(r.use_gated_mlp),
    )
    cols = [c for c in d.columns if c.startswith("time_stats.")]
    d = d.groupby(["num_tensor_parallel_workers", "num_tokens"], as_index=False)[cols].mean()
    d = d.rename(columns=lambda c: c.split(".")[1] if c.startswith("time_stats.") else c)
    return shape, {
        int(tp): g.sort_values("num_tokens").reset_index(drop=True)
        for tp, g in d.groupby("num_tensor_parallel_workers")
    }


def measured_parts(g: pd.DataFrame) -> tuple[np.ndarray, dict, np.ndarray, int]:
    """Tokens, linear group seconds, element-wise seconds and how many element-wise kernels."""
    elem = [c for c in ELEMENTWISE if c in g]
    return (
        g.num_tokens.to_numpy(float),
        {k: g[v].to_numpy(float) * 1e-3 for k, v in COLUMNS.items()},
        g[elem].sum(axis=1).to_numpy(float) * 1e-3,
        len(elem),
    )


def roofline_layer(hw: dict, s: Shape, tokens, tp: int) -> np.ndarray:
    """The whole-forward roofline for one layer's matmuls: max(compute, memory), no floors."""
    params = sum(s.linear_params(tp).values())
    compute = 2.0 * np.asarray(tokens, float) * params / (hw["peak_tflops"] * 1e12 * ROOFLINE["compute_efficiency"])
    memory = params * s.dtype_bytes / (hw["mem_bw_gbs"] * 1e9 * ROOFLINE["memory_efficiency"])
    return np.maximum(compute, memory)


def per_op_layer(c: OpCosts, s: Shape, tokens, tp: int, kernels: int) -> np.ndarray:
    return sum(linear_times(c, s, tokens, tp).values()) + elementwise_time(c, s, tokens, tp, kernels)


def mape(pred, meas) -> float:
    pred, meas = np.asarray(pred, float), np.asarray(meas, float)
    return float(np.mean(np.abs(pred / meas - 1)) * 100)


def crossing(layer, tokens: np.ndarray, times: np.ndarray, q: int) -> int | None:
    """The smallest power-of-two batch B where the layer at B q tokens costs Q_RATIO x B."""
    for b in (2**i for i in range(0, 12)):
        if b * q > tokens.max():
            return None
        if layer(b * q) / layer(b) >= Q_RATIO:
            return b
    return None


def main() -> None:
    results, rows, cross_rows = {}, [], []
    for gpu, preset in GPUS.items():
        hw = load_preset_data("hardware", preset)
        models = {p.parent.name: read_model(p) for p in sorted((DATA / "compute" / gpu).glob("*/mlp.csv"))}
        train = []
        for name, (s, by_tp) in models.items():
            if name in CALIBRATE:
                for tp, g in by_tp.items():
                    tokens, lin, elem, k = measured_parts(g)
                    train.append((s, tp, tokens, lin, elem, k))
        base = OpCosts(hw["peak_tflops"], hw["mem_bw_gbs"])
        c = fit_op_costs(base, train)
        net = pd.read_csv(DATA / "network" / NETWORK[gpu] / "all_reduce.csv")
        net = net[net.num_workers == net.devices_per_node]
        fit_rows = net[net.num_workers.isin([2, 8]) & (net["size"] <= 8 << 20)]
        c_ar = fit_allreduce(c, fit_rows.num_workers, fit_rows["size"], fit_rows["time_stats.all_reduce.median"] * 1e-3)
        per_regime = {"roofline": {}, "per-op": {}}
        for regime, (lo, hi) in REGIMES.items():
            meas, old, new = [], [], []
            for name, (s, by_tp) in models.items():
                if name in CALIBRATE:
                    continue
                for tp, g in by_tp.items():
                    g = g[(g.num_tokens >= lo) & (g.num_tokens <= hi)]
                    if g.empty:
                        continue
                    tokens, lin, elem, k = measured_parts(g)
                    meas.append(sum(lin.values()) + elem)
                    old.append(roofline_layer(hw, s, tokens, tp))
                    new.append(per_op_layer(c, s, tokens, tp, k))
            meas, old, new = (np.concatenate(x) for x in (meas, old, new))
            per_regime["roofline"][regime] = mape(old, meas)
            per_regime["per-op"][regime] = mape(new, meas)
        # all-reduce on TP 4 at decode message sizes (T x hidden x 2 bytes, T <= 512, hidden 4096-8192)
        tp4 = net[(net.num_workers == 4) & (net["size"] <= 512 * 8192 * 2)]
        ar_meas = tp4["time_stats.all_reduce.median"].to_numpy(float) * 1e-3
        old_ar = OpCosts(
            hw["peak_tflops"],
            hw["mem_bw_gbs"],
            allreduce_latency_us=ROOFLINE["allreduce_latency_us"],
            allreduce_bus_gbs=ROOFLINE["nvlink_gbs"],
        )
        per_regime["roofline"]["TP all-reduce"] = mape(allreduce_time(old_ar, tp4["size"], 4), ar_meas)
        per_regime["per-op"]["TP all-reduce"] = mape(allreduce_time(c_ar, tp4["size"], 4), ar_meas)
        # the same form fitted on the reported rows themselves: how close the data lets it come
        in_sample = {
            "TP all-reduce": mape(
                allreduce_time(fit_allreduce(c, np.full(len(tp4), 4), tp4["size"], ar_meas), tp4["size"], 4), ar_meas
            )
        }
        attn = {}
        att_path = DATA / "compute" / gpu / "n_embd8192_q64_kv8_tp2" / "attention.csv"
        if att_path.is_file():
            a = pd.read_csv(att_path)
            a = a[~a.is_prefill]
            s = Shape(8192, 64, 8, 128, 28672)
            fit_part, test = a[a.kv_cache_size <= 1024], a[a.kv_cache_size >= 2048]
            c_att = fit_attention(
                c, s, 2, fit_part.batch_size, fit_part.kv_cache_size, fit_part["time_stats.attn_decode.median"] * 1e-3
            )
            meas = test["time_stats.attn_decode.median"].to_numpy(float) * 1e-3
            # the whole-forward roofline prices attention as KV bytes inside its max (no floor)
            kv_bytes = test.batch_size * test.kv_cache_size * 2 * 8 * 128 / 2 * 2
            old = kv_bytes / (hw["mem_bw_gbs"] * 1e9 * ROOFLINE["memory_efficiency"])
            per_regime["roofline"]["long-context attention"] = mape(old, meas)
            per_regime["per-op"]["long-context attention"] = mape(
                attention_time(c_att, s, 1, test.batch_size * test.kv_cache_size, 2), meas
            )
            attn = dict(attention_eff=c_att.attention_eff, attention_floor_us=c_att.attention_floor_us)
            c_self = fit_attention(c, s, 2, test.batch_size, test.kv_cache_size, meas)
            in_sample["long-context attention"] = mape(
                attention_time(c_self, s, 1, test.batch_size * test.kv_cache_size, 2), meas
            )
        for model_name, (s, by_tp) in models.items():
            if model_name in CALIBRATE or 1 not in by_tp:
                continue
            tokens, lin, elem, k = measured_parts(by_tp[1])
            meas_t = sum(lin.values()) + elem

            def measured_layer(t, tokens=tokens, meas_t=meas_t):
                return float(np.interp(t, tokens, meas_t))

            def new_layer(t, s=s, k=k):
                return float(per_op_layer(c, s, t, 1, k))

            def old_layer(t, s=s):
                return float(roofline_layer(hw, s, t, 1))

            for q in (2, 4, 8):
                m, n, o = (crossing(f, tokens, meas_t, q) for f in (measured_layer, new_layer, old_layer))
                ok = m is not None and n is not None and abs(np.log2(n) - np.log2(m)) <= 1
                cross_rows.append([gpu, model_name, q, m, n, o, "yes" if ok else "no"])
        fitted = {k: v for k, v in c.to_dict().items() if not k.startswith("attention")}
        results[gpu] = dict(
            fitted={
                **fitted,
                "allreduce_latency_us": c_ar.allreduce_latency_us,
                "allreduce_bus_gbs": c_ar.allreduce_bus_gbs,
                **attn,
            },
            calibrated_on=sorted(CALIBRATE & set(models)),
            held_out=sorted(set(models) - CALIBRATE - {"n_embd8192_q64_kv8_tp2"}),
            mape=per_regime,
            mape_fitted_on_reported=in_sample,
        )
        for regime in per_regime["per-op"]:
            rows.append(
                [gpu, regime, per_regime["roofline"][regime], per_regime["per-op"][regime], in_sample.get(regime, "-")]
            )
    text = (
        "Vidur's measured per-layer kernel times (data/vidur) against a whole-forward roofline and the calibrated "
        "per-op model, on held-out models (MAPE %)\n\n"
        + table(["gpu", "regime", "roofline MAPE %", "per-op MAPE %", "per-op fitted on these rows"], rows)
        + f"\n\nbatch where verifying q tokens per sequence costs {Q_RATIO}x plain decoding (TP 1, layer "
        "linears + element-wise; powers of two; within one bucket = per-op within a factor 2 of measured)\n\n"
        + table(["gpu", "model", "q", "measured B", "per-op B", "roofline B", "within one bucket"], cross_rows)
        + "\n\nfitted per GPU: "
        + "; ".join(
            f"{g}: "
            + ", ".join(
                f"{k} {v:.3g}"
                for k, v in r["fitted"].items()
                if k not in ("peak_tflops", "mem_bw_gbs", "elementwise_kernels")
            )
            for g, r in results.items()
        )
    )
    print(text)
    write_result(
        "gpu_costs",
        dict(
            gpus=results,
            crossings=[
                dict(zip(["gpu", "model", "q", "measured", "per_op", "roofline", "within_bucket"], r))
                for r in cross_rows
            ],
        ),
        text,
    )


if __name__ == "__main__":
    main()
