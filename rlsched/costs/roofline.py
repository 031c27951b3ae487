"""Analytic cost model of one forward pass, op group by op group, and of an engine step.

A forward over `q` new tokens for each of `batch` sequences whose contexts sum to `ctx`, on one
GPU of a TP group, is per layer the sum of its op groups (`costs/ops.py`), each on its own
roofline with a floor: the QKV, O, MLP up and MLP down matmuls (memory-bound on their weights
at few tokens, compute-bound at many, each turning at its own token count), the element-wise
kernels, attention (the KV cache it reads, or its products in prefill) and two all-reduces
when tp > 1; the LM head once. Efficiencies and floors are the hardware preset's, calibrated
on measured GPU kernel timings (data/vidur, bench/gpu_costs.py). Verify adds the per-step
overhead; draft forwards add a smaller per-forward overhead. Small batches are memory-bound
(extra tokens nearly free); large ones compute-bound (cost grows with q): the physics that
makes the best draft length depend on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rlsched.config import DrafterSpec, HardwareSpec, ModelSpec, SimConfig, eagle_head
from rlsched.costs.ops import (
    OpCosts,
    Shape,
    allreduce_time,
    attention_time,
    elementwise_time,
    linear_time,
    linear_times,
    mixed_attention_time,
)


def op_costs(hw: HardwareSpec) -> OpCosts:
    """The per-op efficiencies and floors of a hardware preset."""
    return OpCosts(
        hw.peak_tflops,
        hw.mem_bw_gbs,
        compute_eff=hw.compute_efficiency,
        memory_eff=hw.memory_efficiency,
        linear_floor_us=hw.linear_floor_us,
        linear_knee=hw.linear_knee,
        elementwise_eff=hw.elementwise_efficiency,
        elementwise_floor_us=hw.elementwise_floor_us,
        elementwise_row_gbs=hw.elementwise_row_gbs,
        attention_eff=hw.attention_efficiency,
        attention_floor_us=hw.attention_floor_us,
        allreduce_latency_us=hw.allreduce_latency_us,
        allreduce_bus_gbs=hw.nvlink_gbs,
    )


class _Forward:
    """One model's forward on one GPU of a TP group of `tp`, priced per op group."""

    def __init__(self, hw: HardwareSpec, m: ModelSpec, tp: int):
        self.c, self.tp, self.layers = op_costs(hw), tp, m.layers
        self.shape = Shape(m.hidden, m.heads, m.kv_heads, m.head_dim, m.intermediate, True, m.dtype_bytes)
        self.head_params, self.hidden, self.vocab = m.vocab * m.hidden / tp, m.hidden, m.vocab
        self.fusion_params = m.fusion_params / tp

    def _tokens_part(self, tokens):
        """Everything that depends on the new tokens alone: the layers' matmuls, element-wise
        kernels and all-reduces, and the LM head."""
        s, c, tp = self.shape, self.c, self.tp
        layer = (
            sum(linear_times(c, s, tokens, tp).values())
            + elementwise_time(c, s, tokens, tp)
            + 2 * allreduce_time(c, np.asarray(tokens, dtype=float) * s.hidden * s.dtype_bytes, tp)
        )
        head = linear_time(c, self.head_params, self.hidden + self.vocab / tp, tokens, s.dtype_bytes)
        if self.fusion_params:  # (an EAGLE-3 head's projection of the target's hidden states)
            head = head + linear_time(c, self.fusion_params, 4 * self.hidden, tokens, s.dtype_bytes)
        return self.layers * layer + head

    def time(self, batch: int, q, ctx_tokens: int):
        """Seconds for one forward; `q` or `ctx_tokens` may be arrays (then an array comes back)."""
        tokens = batch * np.asarray(q, dtype=float)
        # each new token attends to the cached context and, causally, to half the new ones
        attn = attention_time(self.c, self.shape, q, np.asarray(ctx_tokens, dtype=float) + 0.5 * tokens, self.tp)
        out = self._tokens_part(tokens) + self.layers * attn
        return out if isinstance(out, np.ndarray) and out.ndim else float(out)

    def prefill(self, n_tokens: int, sum_sq_tokens: int | None) -> float:
        """Seconds for one forward over prompts totalling n_tokens (attention quadratic in
        each length: sum_sq_tokens, the sum of squared lengths; default one sequence)."""
        sq = n_tokens * n_tokens if sum_sq_tokens is None else sum_sq_tokens
        # causal attention over n_tokens keys and values, each token against sq / (2 n_tokens)
        # of them on average (QK^T and PV over half of each prompt's square)
        attn = attention_time(self.c, self.shape, sq / (2.0 * n_tokens), n_tokens, self.tp)
        return float(self._tokens_part(n_tokens) + self.layers * attn)

    def mixed(self, batch: int, q: float, ctx_tokens: int, chunk_prefix, chunk_len) -> float:
        """Seconds for one forward over `batch` decode/verify rows of `q` new tokens each (their
        contexts summing to ctx_tokens) beside prompt chunks of `chunk_len` tokens after
        `chunk_prefix` cached ones: the token-bound ops over all tokens at once, one attention."""
        dec = batch * float(q)
        tokens = dec + float(np.sum(chunk_len))
        attn = mixed_attention_time(
            self.c, self.shape, q, float(ctx_tokens) + 0.5 * dec if batch else 0.0, chunk_prefix, chunk_len, self.tp
        )
        return float(self._tokens_part(tokens) + self.layers * attn)


class RooflineCostModel:
    """CostModel for a target model, its drafters and one hardware type, on TP groups of `tp`."""

    kind = "roofline"

    def __init__(self, hardware: HardwareSpec, model: ModelSpec, drafters: Sequence[DrafterSpec] = (), tp: int = 1):
        self.hardware, self.model, self.tp = hardware, model, tp
        self._step_oh = hardware.step_overhead_ms * 1e-3
        self._fwd_oh = hardware.forward_overhead_ms * 1e-3
        self._target = _Forward(hardware, model, tp)
        self._drafters: dict[str, tuple[str, _Forward | None]] = {}
        self._drafter_weight_bytes = 0
        for d in drafters:
            spec = d.model if d.kind == "model" else eagle_head(model, d.draft_vocab) if d.kind == "eagle" else None
            self._drafters[d.name] = (d.kind, _Forward(hardware, spec, tp) if spec is not None else None)
            self._drafter_weight_bytes += spec.weight_bytes if spec is not None else 0
        self._host_base = hardware.host_draft_base_us * 1e-6
        self._host_seq = hardware.host_draft_us_per_seq * 1e-6
        self._mig_bw = tp * hardware.migrate_link_gbs * 1e9
        self._mig_lat = hardware.migrate_latency_ms * 1e-3
        self._kv_bytes = model.kv_bytes_per_token + sum(
            d.model.kv_bytes_per_token for d in drafters if d.kind == "model" and d.model is not None
        )

    @classmethod
    def from_config(cls, cfg: SimConfig) -> RooflineCostModel:
        return cls(cfg.hardware, cfg.model, cfg.drafters, cfg.cluster.tp)

    @property
    def drafters(self) -> tuple[str, ...]:
        return tuple(self._drafters)

    def verify_time(self, batch: int, q, ctx_tokens: int):
        """One target step over q tokens per sequence (q = 1 is plain decoding)."""
        return self._target.time(batch, q, ctx_tokens) + self._step_oh

    def draft_time(self, drafter: str, batch: int, k, ctx_tokens: int, width: int = 1):
        """Proposing k tokens per sequence: k sequential drafter forwards of `width` tokens,
        or host work for n-gram/suffix matching."""
        kind, fwd = self._drafters[drafter]
        if fwd is None:
            host = self._host_base + self._host_seq * batch
            shape = np.broadcast(k, ctx_tokens).shape
            return np.full(shape, host) if shape else host
        return k * (fwd.time(batch, width, ctx_tokens) + self._fwd_oh)

    def draft_time_per_row(self, drafter: str, ks: np.ndarray, ctx_tokens):
        """Drafting ragged lengths: forward j runs over the sequences that draft >= j tokens.
        `ks` is (..., batch): leading axes price several allocations at once; `ctx_tokens`
        (the batch's total context) is a number or matches the leading axes."""
        kind, fwd = self._drafters[drafter]
        ks = np.asarray(ks)
        batch = ks.shape[-1]
        if fwd is None:  # host matching: one pass over the sequences that draft at all
            n = (ks > 0).sum(axis=-1)
            return np.where(n > 0, self._host_base + self._host_seq * n, 0.0)
        k_max = int(ks.max(initial=0))
        if k_max == 0:
            return np.zeros(ks.shape[:-1]) if ks.ndim > 1 else 0.0
        active = (ks[..., None] >= np.arange(1, k_max + 1)).sum(axis=-2)  # (..., k_max)
        ctx = np.asarray(ctx_tokens, dtype=float)[..., None] * active / batch
        per = np.where(active > 0, fwd.time(active, 1, ctx) + self._fwd_oh, 0.0)
        return per.sum(axis=-1)

    def prefill_time(self, n_tokens: int, sum_sq_tokens: int | None = None) -> float:
        """Prefill of prompts totalling n_tokens; attention is quadratic in each length
        (sum_sq_tokens = sum of squared lengths; defaults to one sequence)."""
        if n_tokens <= 0:
            return 0.0
        return self._target.prefill(n_tokens, sum_sq_tokens) + self._step_oh

    @property
    def step_overhead(self) -> float:
        """Seconds of host work per engine step (scheduling, sampling, launch), inside
        verify_time, prefill_time and mixed_time."""
        return self._step_oh

    def mixed_time(self, batch: int, q: float, ctx_tokens: int, chunk_prefix, chunk_len) -> float:
        """One step of `batch` decode/verify rows (q tokens each, contexts summing to ctx_tokens)
        beside prompt chunks (`chunk_len` tokens after `chunk_prefix` cached, arrays): one
        forward over all their tokens, plus the step overhead. Without chunks it is
        verify_time; without rows, chunks with no prefix are prefill_time."""
        return self._target.mixed(batch, q, ctx_tokens, chunk_prefix, chunk_len) + self._step_oh

    def drafter_prefill_time(self, drafter: str, n_tokens: int, sum_sq_tokens: int | None = None) -> float:
        """A model drafter's catch-up: one forward over the tokens it has not seen (a joining
        row's prompt, the tokens of off steps), as prefill_time prices the target's; host
        drafters (n-gram, suffix) index tokens as they come, at no step's expense."""
        kind, fwd = self._drafters[drafter]
        if fwd is None or n_tokens <= 0:
            return 0.0
        return fwd.prefill(n_tokens, sum_sq_tokens) + self._fwd_oh

    def kv_transfer_time(self, ctx_tokens: int, n_seqs: int) -> float:
        """Shipping the KV caches (target and model drafter) of sequences to another instance."""
        if n_seqs <= 0:
            return 0.0
        return self._mig_lat + ctx_tokens * self._kv_bytes / self._mig_bw

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9, activation_reserve_gib: float = 2.0) -> int:
        """KV tokens an instance holds: memory left after weights (target and drafters) and
        activations, over the KV bytes per token."""
        hw = self.hardware
        budget = self.tp * hw.memory_gib * 2**30 * gpu_memory_utilization - activation_reserve_gib * 2**30 * self.tp
        budget -= self.weight_bytes
        return max(0, int(budget // self._kv_bytes))

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights an instance holds: the target's and its drafters' (n-gram: none)."""
        return self.model.weight_bytes + self._drafter_weight_bytes

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "hardware": self.hardware.name,
            "model": self.model.name,
            "tp": self.tp,
            "drafters": {n: k for n, (k, _) in self._drafters.items()},
        }
