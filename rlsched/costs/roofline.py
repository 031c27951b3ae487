"""Analytic roofline cost model of one forward pass, and of the pieces of an engine step.

A forward over `q` new tokens for each of `batch` sequences whose contexts sum to `ctx`:
  FLOPs = 2 * matmul_params * batch * q  +  4 * layers * attn_dim * q * ctx   (QK^T and PV)
  bytes = weights + KV read (ctx tokens) + KV written (batch * q tokens)
  time  = max(FLOPs / (tp * peak * eff_c), bytes / (tp * bw * eff_m)) + TP all-reduces
Verify adds the per-step overhead; draft forwards add a smaller per-forward overhead.
Small batches are memory-bound (extra tokens nearly free); large ones compute-bound
(cost grows with q) - the physics that makes the best draft length depend on the batch.
"""

from __future__ import annotations

import numpy as np

from rlsched.config import DrafterSpec, HardwareSpec, ModelSpec, SimConfig, eagle_head


class _Forward:
    """Precomputed roofline coefficients of one model on one TP group."""

    def __init__(self, hw: HardwareSpec, m: ModelSpec, tp: int):
        flops_rate = tp * hw.peak_tflops * 1e12 * hw.compute_efficiency
        bw = tp * hw.mem_bw_gbs * 1e9 * hw.memory_efficiency
        self.c_tok = 2.0 * m.matmul_params / flops_rate  # s per new token
        self.c_attn = 4.0 * m.layers * m.attn_dim / flops_rate  # s per (new token x context token)
        self.m_weights = m.weight_bytes / bw
        self.m_kv = m.kv_bytes_per_token / bw  # s per KV token read or written
        if tp > 1:
            ring = 2.0 * (tp - 1) / tp
            self.ar_fixed = 2 * m.layers * hw.allreduce_latency_us * 1e-6
            self.ar_tok = 2 * m.layers * ring * m.hidden * m.dtype_bytes / (hw.nvlink_gbs * 1e9)
        else:
            self.ar_fixed = self.ar_tok = 0.0

    def time(self, batch: int, q, ctx_tokens: int):
        """Seconds for one forward; `q` or `ctx_tokens` may be arrays (then an array comes back)."""
        tokens = batch * q
        compute = self.c_tok * tokens + self.c_attn * q * (ctx_tokens + 0.5 * tokens)
        memory = self.m_weights + self.m_kv * (ctx_tokens + tokens)
        core = np.maximum(compute, memory) if isinstance(compute, np.ndarray) else max(compute, memory)
        return core + self.ar_fixed + self.ar_tok * tokens

    def prefill(self, n_tokens: int, sum_sq_tokens: int | None) -> float:
        """Seconds for one forward over prompts totalling n_tokens (attention quadratic in
        each length: sum_sq_tokens, the sum of squared lengths; default one sequence)."""
        sq = n_tokens * n_tokens if sum_sq_tokens is None else sum_sq_tokens
        compute = self.c_tok * n_tokens + 0.5 * self.c_attn * sq
        memory = self.m_weights + self.m_kv * n_tokens
        return max(compute, memory) + self.ar_fixed + self.ar_tok * n_tokens


class RooflineCostModel:
    """CostModel for a target model, its drafters and one hardware type, on TP groups of `tp`."""

    kind = "roofline"

    def __init__(self, hardware: HardwareSpec, model: ModelSpec, drafters: list[DrafterSpec] = (), tp: int = 1):
        self.hardware, self.model, self.tp = hardware, model, tp
        self._step_oh = hardware.step_overhead_ms * 1e-3
        self._fwd_oh = hardware.forward_overhead_ms * 1e-3
        self._target = _Forward(hardware, model, tp)
        self._drafters: dict[str, tuple[str, _Forward | None]] = {}
        self._drafter_weight_bytes = 0
        for d in drafters:
            spec = d.model if d.kind == "model" else eagle_head(model) if d.kind == "eagle" else None
            self._drafters[d.name] = (d.kind, _Forward(hardware, spec, tp) if spec is not None else None)
            self._drafter_weight_bytes += spec.weight_bytes if spec is not None else 0
        self._host_base = hardware.host_draft_base_us * 1e-6
        self._host_seq = hardware.host_draft_us_per_seq * 1e-6
        self._mig_bw = tp * hardware.migrate_link_gbs * 1e9
        self._mig_lat = hardware.migrate_latency_ms * 1e-3
        self._kv_bytes = model.kv_bytes_per_token + sum(
            d.model.kv_bytes_per_token for d in drafters if d.kind == "model")

    @classmethod
    def from_config(cls, cfg: SimConfig) -> "RooflineCostModel":
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
        budget -= self.model.weight_bytes + self._drafter_weight_bytes
        return max(0, int(budget // self._kv_bytes))

    def describe(self) -> dict:
        return {"kind": self.kind, "hardware": self.hardware.name, "model": self.model.name, "tp": self.tp,
                "drafters": {n: k for n, (k, _) in self._drafters.items()}}

