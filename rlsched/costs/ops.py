"""A transformer layer priced op group by op group, each on its own roofline with a floor.

One forward over T new tokens on one GPU of a tensor-parallel group of `tp` is, per layer:

- four linear groups (QKV, O, MLP up with its gate, MLP down), each
  smax(2 T' P / (peak * compute_eff), (P + T (in + out)) * bytes / (bw * memory_eff)) + linear_floor,
  P the group's weights on this GPU, T' the tokens rounded up to whole GEMM tiles of
  `linear_tile` rows (a tile computes all its rows however few are used), smax(a, b) =
  (a^k + b^k)^(1/k) a smooth max of sharpness k = `linear_knee` (weight loads and tensor-core
  math overlap imperfectly near the turn): small T reads the weights (memory-bound), large T is
  compute-bound, and the groups turn at their own T;
- the element-wise kernels (two norms, rope, the MLP activation, the residual add), each a
  floor, plus the larger of their bytes read and written at `elementwise_eff` of the bandwidth
  and one token's row at `elementwise_row_gbs`: these kernels give each token's row to one
  thread block, so a few tokens leave the GPU idle and the widest row sets the time;
- attention, memory-bound on the KV cache it reads in decode, compute-bound in prefill, plus
  a floor; it adds to the linears, it does not hide behind them;
- two all-reduces when tp > 1, each a latency plus its bytes over the bus bandwidth.

A step mixing decode/verify rows with prompt chunks (vLLM's chunked prefill) runs the linears,
element-wise kernels and all-reduces over all its tokens at once and one attention kernel over
the rows and chunks together (`mixed_attention_time`).

`OpCosts` holds the efficiencies and floors of one GPU; `layer_time` and `attention_time` price
with them. `fit_op_costs` calibrates them on measured per-op timings (Vidur's profiles, stored
in data/vidur), in relative error, so that one set holds across model sizes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

LINEARS = ("qkv", "o", "up", "down")


@dataclass(frozen=True)
class Shape:
    """A decoder layer's numbers (the whole model's, before TP sharding)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    gated: bool = True
    dtype_bytes: int = 2

    def linear_params(self, tp: int) -> dict[str, float]:
        """Weights per linear group on one GPU of the TP group."""
        h, a, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        up = self.intermediate * (2 if self.gated else 1)
        return {"qkv": h * (a + 2 * kv) / tp, "o": a * h / tp, "up": h * up / tp, "down": self.intermediate * h / tp}

    def linear_io(self, tp: int) -> dict[str, float]:
        """Activation elements read and written per token by each linear group on one GPU."""
        h, a, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        up = self.intermediate * (2 if self.gated else 1) / tp
        return {"qkv": h + (a + 2 * kv) / tp, "o": a / tp + h, "up": h + up, "down": self.intermediate / tp + h}

    def elementwise_elements(self, tp: int) -> float:
        """Elements read and written per token by the element-wise kernels of one layer: two
        norms (h in, h out), rope on q and k, the activation (gated: two in, one out), the
        residual add (two in, one out)."""
        h, a, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        act = self.intermediate / tp * (3 if self.gated else 2)
        return 2 * 2 * h + 2 * (a + kv) / tp + act + 3 * h


@dataclass(frozen=True)
class OpCosts:
    """One GPU's peaks and the efficiencies and floors its kernels reach."""

    peak_tflops: float
    mem_bw_gbs: float
    compute_eff: float = 0.7
    memory_eff: float = 0.85
    linear_floor_us: float = 5.0
    elementwise_eff: float = 0.4
    elementwise_floor_us: float = 3.0
    elementwise_kernels: int = 5
    elementwise_row_gbs: float = 8.0  # bandwidth of one token's row, in one thread block
    linear_knee: float = 1.6  # sharpness of the memory-to-compute turn (large: a plain max)
    linear_tile: int = 32  # tokens per GEMM tile: compute runs on whole tiles
    attention_eff: float = 0.6  # of the bandwidth, reading the KV cache
    attention_floor_us: float = 10.0
    allreduce_latency_us: float = 20.0
    allreduce_bus_gbs: float = 150.0

    def to_dict(self) -> dict:
        return asdict(self)


def linear_time(c: OpCosts, params: float, io: float, tokens, dtype_bytes: int = 2) -> np.ndarray:
    """Seconds of one matmul of `params` weights over `tokens` new tokens, reading and writing
    `io` activation elements per token: the smooth max of computing whole tiles of tokens and
    reading the weights and activations, plus a floor."""
    t = np.asarray(tokens, dtype=float)
    tiled = np.ceil(t / c.linear_tile) * c.linear_tile
    compute = 2.0 * tiled * params / (c.peak_tflops * 1e12 * c.compute_eff)
    memory = (params + t * io) * dtype_bytes / (c.mem_bw_gbs * 1e9 * c.memory_eff)
    hi, lo = np.maximum(compute, memory), np.minimum(compute, memory)
    return hi * (1.0 + (lo / hi) ** c.linear_knee) ** (1.0 / c.linear_knee) + c.linear_floor_us * 1e-6


def linear_times(c: OpCosts, s: Shape, tokens, tp: int = 1) -> dict[str, np.ndarray]:
    """Seconds of each linear group of one layer over `tokens` new tokens (array-like)."""
    io = s.linear_io(tp)
    return {g: linear_time(c, p, io[g], tokens, s.dtype_bytes) for g, p in s.linear_params(tp).items()}


def elementwise_time(c: OpCosts, s: Shape, tokens, tp: int = 1, kernels: int | None = None) -> np.ndarray:
    """Seconds of one layer's element-wise kernels over `tokens` new tokens: a floor each, plus
    the larger of one token's row in one thread block and all rows at the bandwidth."""
    t = np.asarray(tokens, dtype=float)
    n = c.elementwise_kernels if kernels is None else kernels
    row = s.elementwise_elements(tp) * s.dtype_bytes
    return n * c.elementwise_floor_us * 1e-6 + np.maximum(
        row / (c.elementwise_row_gbs * 1e9), t * row / (c.mem_bw_gbs * 1e9 * c.elementwise_eff)
    )


def attention_time(c: OpCosts, s: Shape, q, ctx_tokens, tp: int = 1) -> np.ndarray:
    """Seconds of one layer's attention: `q` new tokens for each sequence against KV caches
    holding `ctx_tokens` tokens in all (the batch's total): the larger of the KV read and the
    QK^T and PV products, plus a floor."""
    q, ctx = np.asarray(q, dtype=float), np.asarray(ctx_tokens, dtype=float)
    kv_bytes = ctx * 2 * s.kv_heads * s.head_dim / tp * s.dtype_bytes
    flops = 4.0 * q * ctx * s.heads * s.head_dim / tp
    return (
        np.maximum(kv_bytes / (c.mem_bw_gbs * 1e9 * c.attention_eff), flops / (c.peak_tflops * 1e12 * c.compute_eff))
        + c.attention_floor_us * 1e-6
    )


def mixed_attention_time(c: OpCosts, s: Shape, decode_q, decode_kv, chunk_prefix, chunk_len, tp: int = 1) -> float:
    """Seconds of one layer's attention in a step that mixes decode/verify rows with prompt
    chunks, one kernel over both (vLLM's varlen attention): decode rows of `decode_q` new tokens
    each read `decode_kv` cached tokens in all (their new tokens' causal half included, as
    `attention_time` is called for decode); a chunk of c tokens after p cached ones reads p + c
    tokens of KV and forms c (p + c / 2) query-key pairs (causal within the chunk). The KV read
    and the products are summed over rows and chunks, then priced as `attention_time` prices
    one batch (a chunk with p = 0 is a plain prefill)."""
    p, n = np.asarray(chunk_prefix, dtype=float), np.asarray(chunk_len, dtype=float)
    kv = float(decode_kv) + float((p + n).sum())
    pairs = float(decode_q) * float(decode_kv) + float((n * (p + 0.5 * n)).sum())
    if kv <= 0:
        return 0.0
    return float(attention_time(c, s, pairs / kv, kv, tp))


def allreduce_time(c: OpCosts, nbytes, tp: int) -> np.ndarray:
    """Seconds of one ring all-reduce of `nbytes` per GPU over `tp` GPUs (0 for tp = 1)."""
    b = np.asarray(nbytes, dtype=float)
    if tp <= 1:
        return np.zeros_like(b)
    return c.allreduce_latency_us * 1e-6 + b * 2 * (tp - 1) / tp / (c.allreduce_bus_gbs * 1e9)


def layer_time(c: OpCosts, s: Shape, tokens, tp: int = 1, q=1, ctx_tokens=0) -> np.ndarray:
    """Seconds of one layer: the linears, the element-wise kernels, attention (when the
    batch has a context) and the two all-reduces."""
    t = np.asarray(tokens, dtype=float)
    total = sum(linear_times(c, s, t, tp).values()) + elementwise_time(c, s, t, tp)
    if np.any(np.asarray(ctx_tokens) > 0):
        total = total + attention_time(c, s, q, ctx_tokens, tp)
    return total + 2 * allreduce_time(c, t * s.hidden * s.dtype_bytes, tp)


# ----------------------------------------------------------------------------- calibration

# the fields fit_op_costs fits, and their ranges (`linear_tile` is the kernels' own and stays fixed)
BOUNDS = {
    "compute_eff": (0.05, 1.0),
    "memory_eff": (0.05, 1.0),
    "linear_floor_us": (0.05, 200.0),
    "linear_knee": (1.0, 50.0),
    "elementwise_eff": (0.01, 1.0),
    "elementwise_floor_us": (0.05, 200.0),
    "elementwise_row_gbs": (0.5, 1000.0),
}
FITTED = tuple(BOUNDS)


def fit_op_costs(
    base: OpCosts, rows: list[tuple[Shape, int, np.ndarray, dict[str, np.ndarray], np.ndarray, int]]
) -> OpCosts:
    """The linear and element-wise efficiencies, floors and shapes (the fields of BOUNDS) that
    minimise the relative error (in log space, each token count weighted by its share of the
    log-token axis) of the linear groups' and element-wise times of `rows`: per measured model
    and TP degree, (shape, tp, tokens, {group: measured seconds}, measured element-wise
    seconds, element-wise kernels measured)."""
    from scipy.optimize import least_squares

    def residuals(x):
        c = _with(base, x)
        res = []
        for s, tp, tokens, linears, elem, kernels in rows:
            w = np.sqrt(_log_share(tokens))
            pred = linear_times(c, s, tokens, tp)
            for g in LINEARS:
                res.append(w * np.log(pred[g] / linears[g]))
            res.append(w * np.log(elementwise_time(c, s, tokens, tp, kernels) / elem))
        return np.concatenate(res)

    x0 = np.log([getattr(base, f) for f in FITTED])
    lo, hi = np.log([BOUNDS[f] for f in FITTED]).T
    fit = least_squares(residuals, np.clip(x0, lo + 1e-9, hi - 1e-9), bounds=(lo, hi))
    return _with(base, fit.x)


def _log_share(tokens) -> np.ndarray:
    """Each token count's share of the log-token axis it samples, so that a grid dense at large
    counts weighs decode and prefill alike."""
    x = np.log(np.asarray(tokens, dtype=float))
    if len(x) < 2:
        return np.ones_like(x)
    return np.gradient(x)


def _with(base: OpCosts, x) -> OpCosts:
    return OpCosts(**{**base.to_dict(), **dict(zip(FITTED, np.exp(x).tolist()))})


def fit_attention(base: OpCosts, s: Shape, tp: int, batch, ctx_per_seq, measured) -> OpCosts:
    """The attention efficiency and floor fitted on measured decode attention times (one new
    token a sequence, `batch` sequences of `ctx_per_seq` cached tokens each)."""
    from scipy.optimize import least_squares

    batch, ctx, measured = (np.asarray(v, dtype=float) for v in (batch, ctx_per_seq, measured))

    def residuals(x):
        c = OpCosts(
            **{**base.to_dict(), "attention_eff": float(np.exp(x[0])), "attention_floor_us": float(np.exp(x[1]))}
        )
        return np.log(attention_time(c, s, 1, batch * ctx, tp) / measured)

    fit = least_squares(
        residuals,
        np.log([base.attention_eff, base.attention_floor_us]),
        bounds=(np.log([0.05, 0.5]), np.log([1.0, 500.0])),
    )
    return OpCosts(
        **{**base.to_dict(), "attention_eff": float(np.exp(fit.x[0])), "attention_floor_us": float(np.exp(fit.x[1]))}
    )


def fit_allreduce(base: OpCosts, tp, nbytes, measured) -> OpCosts:
    """One all-reduce latency and bus bandwidth fitted on measured times (rows of TP degree
    `tp`, message `nbytes` per GPU, seconds)."""
    from scipy.optimize import least_squares

    tp, nbytes, measured = (np.asarray(v, dtype=float) for v in (tp, nbytes, measured))

    def residuals(x):
        pred = np.exp(x[0]) * 1e-6 + nbytes * 2 * (tp - 1) / tp / (np.exp(x[1]) * 1e9)
        return np.log(pred / measured)

    fit = least_squares(
        residuals,
        np.log([base.allreduce_latency_us, base.allreduce_bus_gbs]),
        bounds=(np.log([0.5, 1.0]), np.log([500.0, 5000.0])),
    )
    return OpCosts(
        **{
            **base.to_dict(),
            "allreduce_latency_us": float(np.exp(fit.x[0])),
            "allreduce_bus_gbs": float(np.exp(fit.x[1])),
        }
    )
