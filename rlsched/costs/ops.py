"""A transformer layer priced op group by op group, each on its own roofline with a floor.

One forward over T new tokens on one GPU of a tensor-parallel group of `tp` is, per layer:

- four linear groups (QKV, O, MLP up with its gate, MLP down), each
  max(2 T P / (peak * compute_eff), (P + T (in + out)) * bytes / (bw * memory_eff)) + linear_floor,
  P the group's weights on this GPU: small T reads the weights (memory-bound), large T is
  compute-bound, and the groups turn at their own T;
- the element-wise kernels (two norms, rope, the MLP activation, the residual add), each a
  floor plus its bytes read and written at `elementwise_eff` of the bandwidth;
- attention, memory-bound on the KV cache it reads in decode, compute-bound in prefill, plus
  a floor; it adds to the linears, it does not hide behind them;
- two all-reduces when tp > 1, each a latency plus its bytes over the bus bandwidth.

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
    attention_eff: float = 0.6  # of the bandwidth, reading the KV cache
    attention_floor_us: float = 10.0
    allreduce_latency_us: float = 20.0
    allreduce_bus_gbs: float = 150.0

    def to_dict(self) -> dict:
        return asdict(self)


def linear_time(c: OpCosts, params: float, io: float, tokens, dtype_bytes: int = 2) -> np.ndarray:
    """Seconds of one matmul of `params` weights over `tokens` new tokens, reading and writing
    `io` activation elements per token."""
    t = np.asarray(tokens, dtype=float)
    compute = 2.0 * t * params / (c.peak_tflops * 1e12 * c.compute_eff)
    memory = (params + t * io) * dtype_bytes / (c.mem_bw_gbs * 1e9 * c.memory_eff)
    return np.maximum(compute, memory) + c.linear_floor_us * 1e-6


def linear_times(c: OpCosts, s: Shape, tokens, tp: int = 1) -> dict[str, np.ndarray]:
    """Seconds of each linear group of one layer over `tokens` new tokens (array-like)."""
    io = s.linear_io(tp)
    return {g: linear_time(c, p, io[g], tokens, s.dtype_bytes) for g, p in s.linear_params(tp).items()}


def elementwise_time(c: OpCosts, s: Shape, tokens, tp: int = 1, kernels: int | None = None) -> np.ndarray:
    """Seconds of one layer's element-wise kernels over `tokens` new tokens."""
    t = np.asarray(tokens, dtype=float)
    n = c.elementwise_kernels if kernels is None else kernels
    return n * c.elementwise_floor_us * 1e-6 + t * s.elementwise_elements(tp) * s.dtype_bytes / (
        c.mem_bw_gbs * 1e9 * c.elementwise_eff)


def attention_time(c: OpCosts, s: Shape, q, ctx_tokens, tp: int = 1) -> np.ndarray:
    """Seconds of one layer's attention: `q` new tokens for each sequence against KV caches
    holding `ctx_tokens` tokens in all (the batch's total): the larger of the KV read and the
    QK^T and PV products, plus a floor."""
    q, ctx = np.asarray(q, dtype=float), np.asarray(ctx_tokens, dtype=float)
    kv_bytes = ctx * 2 * s.kv_heads * s.head_dim / tp * s.dtype_bytes
    flops = 4.0 * q * ctx * s.heads * s.head_dim / tp
    return np.maximum(kv_bytes / (c.mem_bw_gbs * 1e9 * c.attention_eff),
                      flops / (c.peak_tflops * 1e12 * c.compute_eff)) + c.attention_floor_us * 1e-6


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

FITTED = ("compute_eff", "memory_eff", "linear_floor_us", "elementwise_eff", "elementwise_floor_us")


def fit_op_costs(base: OpCosts, rows: list[tuple[Shape, int, np.ndarray, dict[str, np.ndarray], np.ndarray,
                                                 int]]) -> OpCosts:
    """The linear and element-wise efficiencies and floors that minimise the relative error
    (in log space) of the linear groups' and element-wise times of `rows`: per measured model
    and TP degree, (shape, tp, tokens, {group: measured seconds}, measured element-wise
    seconds, element-wise kernels measured)."""
    from scipy.optimize import least_squares

    def residuals(x):
        c = _with(base, x)
        res = []
        for s, tp, tokens, linears, elem, kernels in rows:
            pred = linear_times(c, s, tokens, tp)
            for g in LINEARS:
                res.append(np.log(pred[g] / linears[g]))
            res.append(np.log(elementwise_time(c, s, tokens, tp, kernels) / elem))
        return np.concatenate(res)

    x0 = np.log([getattr(base, f) for f in FITTED])
    fit = least_squares(residuals, x0, bounds=(np.log([0.05, 0.05, 0.05, 0.01, 0.05]),
                                               np.log([1.0, 1.0, 200.0, 1.0, 200.0])))
    return _with(base, fit.x)


def _with(base: OpCosts, x) -> OpCosts:
    return OpCosts(**{**base.to_dict(), **dict(zip(FITTED, np.exp(x).tolist()))})


def fit_attention(base: OpCosts, s: Shape, tp: int, batch, ctx_per_seq, measured) -> OpCosts:
    """The attention efficiency and floor fitted on measured decode attention times (one new
    token a sequence, `batch` sequences of `ctx_per_seq` cached tokens each)."""
    from scipy.optimize import least_squares

    batch, ctx, measured = (np.asarray(v, dtype=float) for v in (batch, ctx_per_seq, measured))

    def residuals(x):
        c = OpCosts(**{**base.to_dict(), "attention_eff": float(np.exp(x[0])),
                       "attention_floor_us": float(np.exp(x[1]))})
        return np.log(attention_time(c, s, 1, batch * ctx, tp) / measured)

    fit = least_squares(residuals, np.log([base.attention_eff, base.attention_floor_us]),
                        bounds=(np.log([0.05, 0.5]), np.log([1.0, 500.0])))
    return OpCosts(**{**base.to_dict(), "attention_eff": float(np.exp(fit.x[0])),
                      "attention_floor_us": float(np.exp(fit.x[1]))})


def fit_allreduce(base: OpCosts, tp, nbytes, measured) -> OpCosts:
    """One all-reduce latency and bus bandwidth fitted on measured times (rows of TP degree
    `tp`, message `nbytes` per GPU, seconds)."""
    from scipy.optimize import least_squares

    tp, nbytes, measured = (np.asarray(v, dtype=float) for v in (tp, nbytes, measured))

    def residuals(x):
        pred = np.exp(x[0]) * 1e-6 + nbytes * 2 * (tp - 1) / tp / (np.exp(x[1]) * 1e9)
        return np.log(pred / measured)

    fit = least_squares(residuals, np.log([base.allreduce_latency_us, base.allreduce_bus_gbs]),
                        bounds=(np.log([0.5, 1.0]), np.log([500.0, 5000.0])))
    return OpCosts(**{**base.to_dict(), "allreduce_latency_us": float(np.exp(fit.x[0])),
                      "allreduce_bus_gbs": float(np.exp(fit.x[1]))})
