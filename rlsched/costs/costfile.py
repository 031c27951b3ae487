"""Fitted cost models: the parametric forms, the versioned JSON file, and the CostModel it loads as.

`rlsched fit` (costs/fit.py) writes a file; `simulate`, `compare` and `learn --cost FILE`
and the policies price steps with `load_cost_model(FILE)`. Times are in milliseconds inside
the forms and the file, in seconds through the `CostModel` protocol.

The forms (one per operation, roofline-shaped; every parameter >= 0):

  verify(B, q, L)   = t0 + s*[q > 1] + u*[q = 1, B > 1] + smax(a*B*q, m; p) + r*B
                      + c*B*q*(L + (q - 1)/2) + kv*B*L
  draft(B, k, L)    = e + d*B*L + k * (t0 + smax(a*B, m; p) + c*B*L) + s*(k - 1)*[B > 1]
                      (k drafter forwards)
  prefill(n, S)     = t0 + a*n + c*S/2 + g*h*softplus((S/2 - s_c)/h)
  feed(n, S)        = prefill's form, of a drafter: the tokens it takes in beyond a steady
                      step's one or two a row (a joining row's prompt, the tokens of off steps)

B = rows, q = tokens verified per row (k + 1), k = draft length, L = context per row,
n = prompt tokens, S = sum of squared prompt lengths. smax(x, m; p) = (x^(1+p) + m^(1+p))^(1/(1+p))
is the roofline's max(compute, memory) made smooth: small work is bound by reading the
weights (m), large work by compute (a per token); p sets how sharp the bend is (p -> 0 adds
them, as a launch-overhead-bound CPU does). `s` is the speculative path's extra work over
plain decoding (verification, resampling); `u` plain decoding's over rows of different
lengths, as the engine's are from two rows on (a mask, another attention kernel); in
drafting `s` is that same extra work of each one-token forward after the first (whose feed
of two tokens is masked at any batch size); `r` a per-row cost (sampling, bookkeeping); `c`
attention's arithmetic over the context, for every token verified; `kv` reading each row's
cached keys and values, once a step whatever the number of tokens verified (format v3:
without it attention's whole cost grows with q, which overprices plain decoding at many rows
of short context); `e` and `d` drafting's cost
besides its forwards (a fixed part, and one that grows with the context the drafter's cache
holds). Prefill is compute (a per token, c per token pair of attention) over a floor t0; its
softplus is the memory hierarchy: beyond about s_c token pairs (attention scores of B x heads
x L^2 floats) the scores leave the cache and each further pair costs `g` more. The bend is in
pairs, not tokens: the drafter's feed costs more a token over fewer, longer rows (fewer
tokens, more pairs) than over many short ones, which a bend in tokens prices low. Where a
form misfits, an op keeps the measured grid instead and is priced by interpolation over it,
exactly as `MeasuredCostModel` does. `feed` is optional (files from before it price a
drafter's catch-up at zero).

Two optional entries price what a vLLM engine does besides (`engine.kind: vllm`):

  mixed(B, q, L, n, S) = verify(B, q, L) + t0 + a n + c S / 2
                      (decode/verify rows beside prompt chunks in one forward)
  host              = `step` ms of host work with every step, outside the timed forward

In a mixed step the chunks are n tokens whose S = sum of c (c + 2 p) over chunks of c tokens
after p cached ones (a chunk's query-key pairs, doubled, as a prompt's c^2); the chunks add
their tokens' compute (a, c) and a constant t0 to the rows' forward, whose per-step part and
weight reads they share. The three are fitted to mixed step records themselves: a vLLM rollout
prefills whole prompts in few steps of one size, which fix prefill's time at that size but not
its slope, while its mixed steps carry chunks of every size. Without the entry a mixed step is
verify + prefill less the per-step constant min(verify t0, prefill t0), paid once. Without
chunks it is verify, without rows prefill. `host.step` is the median gap between one
step record's end and the next one's start on an engine (scheduling, output processing, the
policy's hook), charged with every step and counted in `step_overhead`, the host's part of a
step, which vLLM's async scheduling overlaps with the GPU's previous step.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from rlsched.costs.measured import MeasuredCostModel, chunk_pairs, grid_time, measured_grid
from rlsched.errors import UserError

KIND = "rlsched-costmodel"
VERSION = 1

PARAMS = {
    "verify": ("t0", "s", "u", "a", "m", "p", "r", "c", "kv"),
    "draft": ("e", "d", "t0", "a", "m", "p", "c", "s"),
    "prefill": ("t0", "a", "c", "g", "s_c", "h"),
    "feed": ("t0", "a", "c", "g", "s_c", "h"),  # prefill's form, of a drafter
    "mixed": ("t0", "a", "c"),
    "host": ("step", "hook"),
}
FORMS = {
    "verify": "roofline-verify-v3",
    "draft": "roofline-draft-v2",
    "prefill": "roofline-prefill-v2",
    "feed": "roofline-prefill-v2",
    "mixed": "verify-plus-chunks-v2",
    "host": "host-step-v1",
}
TOKENS = {"verify": "q", "draft": "k", "prefill": "one", "feed": "one"}  # the grid's second axis
PER_DRAFTER = ("draft", "feed")  # ops fitted once per drafter: ops.<op>.<drafter> in the file
OPTIONAL = ("mixed", "host")  # ops a file may lack: ops.<op>


def smax(x, m, p):
    """Smooth max of x and m (>= both, -> max as p grows, x + m at p = 0), overflow-safe."""
    e = 1.0 + p
    hi = np.maximum(np.maximum(x, m), 1e-300)
    return hi * ((x / hi) ** e + (m / hi) ** e) ** (1.0 / e)


def softplus(x):
    return np.logaddexp(0.0, x)


def verify_ms(p: dict, B, q, L):
    B, q, L = (np.asarray(v, dtype=float) for v in (B, q, L))
    return (
        p["t0"]
        + p["s"] * (q > 1)
        + p["u"] * ((q == 1) & (B > 1))
        + smax(p["a"] * B * q, p["m"], p["p"])
        + p["r"] * B
        + p["c"] * B * q * (L + (q - 1) / 2)
        + p["kv"] * B * L
    )


def draft_ms(p: dict, B, k, L):
    B, k, L = (np.asarray(v, dtype=float) for v in (B, k, L))
    return (
        p["e"]
        + p["d"] * B * L
        + k * (p["t0"] + smax(p["a"] * B, p["m"], p["p"]) + p["c"] * B * L)
        + p["s"] * np.maximum(k - 1, 0) * (B > 1)
    )


def prefill_ms(p: dict, n, S):
    n, S = np.asarray(n, dtype=float), np.asarray(S, dtype=float)
    h = max(p["h"], 1e-9)
    return p["t0"] + p["a"] * n + p["c"] * S / 2 + p["g"] * h * softplus((S / 2 - p["s_c"]) / h)


def op_ms(op: str, p: dict, batch, tokens, ctx_per_row):
    """The form of `op` on grid coordinates (batch, tokens per row, context per row); for
    prefill and feed tokens is unused and the prompts are `batch` rows of `ctx_per_row` tokens."""
    if op == "verify":
        return verify_ms(p, batch, tokens, ctx_per_row)
    if op == "draft":
        return draft_ms(p, batch, tokens, ctx_per_row)
    n = np.asarray(batch, dtype=float) * ctx_per_row
    return prefill_ms(p, n, n * ctx_per_row)


def grid_interpolator(op: str, points, what: str):
    """MeasuredCostModel's interpolator over (log2 batch, tokens per row, context per row) of
    points [[batch, tokens, ctx_tokens, ms], ...]."""
    df = pd.DataFrame(points, columns=["batch", TOKENS[op], "ctx_tokens", "ms"])
    return measured_grid(df, TOKENS[op], "ms", what)


class FittedCostModel(MeasuredCostModel):
    """CostModel from a `rlsched fit` file: each op is its fitted form, or (where the form
    misfit) interpolation over the measured grid. What a profile cannot know (KV capacity,
    KV transfer between instances) comes from `base`, the config's analytic model, when given.
    `draft_time_per_row` is MeasuredCostModel's: the profiled executor drafts the longest
    row's length for every drafting row."""

    kind = "fitted"

    def __init__(self, data: dict, base=None, path: Path | None = None):
        # not MeasuredCostModel.__init__: that one builds its grids from profile records
        self.data, self.base, self.path = data, base, path
        self._ops = {}
        for key, entry in self._entries():
            op = key.partition(":")[0]
            if entry["used"] == "interpolation":
                self._ops[key] = ("grid", grid_interpolator(op, entry["grid"], f"{path}: {key}"))
            else:
                self._ops[key] = ("form", {k: float(v) for k, v in entry["params"].items()})
        self.drafters = tuple(data["ops"]["draft"])
        ops = data["ops"]
        self._t0 = min(float(ops["verify"]["params"]["t0"]), float(ops["prefill"]["params"]["t0"])) / 1e3
        self._chunk = {k: float(v) for k, v in ops["mixed"]["params"].items()} if "mixed" in ops else None
        self.host_step = float(ops["host"]["params"]["step"]) / 1e3 if "host" in ops else 0.0

    def _entries(self):
        ops = self.data["ops"]
        yield "verify", ops["verify"]
        yield "prefill", ops["prefill"]
        for op in PER_DRAFTER:
            for name, entry in ops.get(op, {}).items():
                yield f"{op}:{name}", entry

    def _eval(self, key: str, batch, tokens, ctx_tokens):
        """Seconds at (rows, tokens per row, the rows' total context); arrays broadcast."""
        how, obj = self._ops[key]
        if how == "grid":  # grid_time shapes everything as `tokens`: broadcast the context in first
            tokens, ctx_tokens = np.broadcast_arrays(
                np.asarray(tokens, dtype=float), np.asarray(ctx_tokens, dtype=float)
            )
            return grid_time(obj, batch, tokens, ctx_tokens)
        b = max(float(batch), 1.0)
        out = np.maximum(op_ms(key.partition(":")[0], obj, b, tokens, np.asarray(ctx_tokens, dtype=float) / b), 0.0)
        out = out / 1e3
        return out if out.ndim else float(out)  # a number for a number, as the roofline model

    def verify_time(self, batch: int, q, ctx_tokens: int):
        return self._eval("verify", batch, q, ctx_tokens) + self.host_step

    def _chunks_s(self, n_tokens: float, sum_sq: float) -> float:
        how, obj = self._ops["prefill"]
        if how == "grid" or sum_sq <= n_tokens**2:
            return self._prompts("prefill", n_tokens, sum_sq)
        return float(max(prefill_ms(obj, n_tokens, sum_sq), 0.0)) / 1e3  # (a chunk after cached tokens)

    def _joint_s(self) -> float:
        return self._t0

    def mixed_time(self, batch: int, q: float, ctx_tokens: int, chunk_prefix, chunk_len) -> float:
        """verify_time of the rows with the fitted chunks' part added (`mixed` entry), or as the
        measured model prices a mixed step where the file has no such entry."""
        n, sq = chunk_pairs(chunk_prefix, chunk_len)
        if self._chunk is None or n <= 0 or batch <= 0:
            return super().mixed_time(batch, q, ctx_tokens, chunk_prefix, chunk_len)
        p = self._chunk
        return float(self.verify_time(batch, q, ctx_tokens)) + (p["t0"] + p["a"] * n + p["c"] * sq / 2) / 1e3

    @property
    def step_overhead(self) -> float:
        """Seconds of a step's fixed part, inside verify_time, prefill_time and mixed_time: the
        fitted per-step constant (min of verify's and prefill's t0) and `host.step`, the host
        work outside the timed forward (vLLM's async scheduling overlaps both with the GPU)."""
        return self._t0 + self.host_step

    def draft_time(self, drafter: str, batch: int, k, ctx_tokens: int, width: int = 1):
        if drafter not in self.drafters:
            raise UserError(
                f"cost model file '{self.path}' has no draft fit for drafter '{drafter}' (it has: "
                f"{', '.join(self.drafters) or 'none'}); profile that drafter and fit again"
            )
        k = np.asarray(k, dtype=float)
        t = self._eval(f"draft:{drafter}", batch * width, np.maximum(k, 1), ctx_tokens * width)
        return np.where(k > 0, t, 0.0) if np.ndim(t) else (t if k > 0 else 0.0)

    def prefill_time(self, n_tokens: int, sum_sq_tokens: int | None = None) -> float:
        """Prompts totalling n_tokens whose squared lengths sum to sum_sq_tokens (default: one
        prompt): as many rows of equal length (n^2 / S rows of S / n tokens)."""
        out = self._prompts("prefill", n_tokens, sum_sq_tokens)
        return out + self.host_step if n_tokens > 0 else out

    def drafter_prefill_time(self, drafter: str, n_tokens: int, sum_sq_tokens: int | None = None) -> float:
        """The drafter's catch-up (prefill_time's arguments): its fitted feed, or zero where the
        file has none (fitted from run traces, or before profiles timed it)."""
        key = f"feed:{drafter}"
        return self._prompts(key, n_tokens, sum_sq_tokens) if key in self._ops else 0.0

    def _prompts(self, key: str, n_tokens: float, sum_sq_tokens: float | None) -> float:
        """Op `key` (prefill's form) over prompts totalling n_tokens whose squared lengths sum
        to sum_sq_tokens (default: one prompt): as many rows of equal length (n^2 / S rows of
        S / n tokens)."""
        if n_tokens <= 0:
            return 0.0
        sq = float(n_tokens) ** 2 if sum_sq_tokens is None else float(max(sum_sq_tokens, 1))
        return float(self._eval(key, max(float(n_tokens) ** 2 / sq, 1.0), 1, n_tokens))

    def kv_transfer_time(self, ctx_tokens: int, n_seqs: int) -> float:
        return self.base.kv_transfer_time(ctx_tokens, n_seqs) if self.base is not None else 0.0

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9, activation_reserve_gib: float = 2.0) -> int:
        if self.base is None:
            raise UserError(f"cost model file '{self.path}': KV capacity is not fitted; set cluster.kv_capacity_tokens")
        return self.base.kv_capacity_tokens(gpu_memory_utilization, activation_reserve_gib)

    def describe(self) -> dict:
        src = self.data.get("source", {})
        return {
            "kind": self.kind,
            "file": str(self.path) if self.path else None,
            "sha256": self.data.get("_sha256"),
            "source": src.get("path"),
            "model": src.get("model"),
            "model_shape": src.get("model_shape"),
            "machine": src.get("machine"),
            "ops": {key: entry["used"] for key, entry in self._entries()},
            "mixed": "fitted" if "mixed" in self.data["ops"] else "verify + prefill less the per-step constant",
            "host_step_ms": self.host_step * 1e3,
            "kv_and_memory_from": self.base.describe()
            if self.base is not None and hasattr(self.base, "describe")
            else None,
        }


# ----------------------------------------------------------------------------- the file


def _bad(path, what: str) -> UserError:
    return UserError(f"cost model file '{path}' {what}; re-create it with `rlsched fit PROFILE_OR_RUNDIR --out {path}`")


def _check_entry(path, key: str, op: str, entry) -> None:
    where = f"ops.{key}"
    if not isinstance(entry, dict):
        raise _bad(path, f"has no valid '{where}' (an object expected)")
    for field in ("used", "form", "params", "quality"):
        if field not in entry:
            raise _bad(path, f"lacks field '{where}.{field}'")
    if entry["used"] not in ("parametric", "interpolation"):
        raise _bad(path, f"has '{where}.used' = {entry['used']!r} (parametric or interpolation expected)")
    if entry["form"] != FORMS[op]:
        raise _bad(path, f"has '{where}.form' = {entry['form']!r}, this rlsched knows {FORMS[op]!r}")
    params = entry["params"]
    if not isinstance(params, dict):
        raise _bad(path, f"has no valid '{where}.params' (an object expected)")
    for name in PARAMS[op]:
        v = params.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise _bad(path, f"has no valid '{where}.params.{name}' (a finite number >= 0 expected, got {v!r})")
    if entry["used"] == "interpolation":
        grid = entry.get("grid")
        if (
            not isinstance(grid, list)
            or not grid
            or not all(
                isinstance(r, list)
                and len(r) == 4
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in r)
                for r in grid
            )
        ):
            raise _bad(path, f"has no valid '{where}.grid' (rows of [batch, tokens, ctx_tokens, ms] expected)")


def read_cost_file(path) -> dict:
    """Read and check a fitted-cost-model file; one UserError line naming the file and the fault."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"cost model file '{path}' does not exist; write one with `rlsched fit PROFILE_OR_RUNDIR --out {path}`"
        )
    raw = path.read_bytes()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad(path, f"is not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise UserError(
            f'cost model file \'{path}\' is not an rlsched cost model (no "kind": "{KIND}"); '
            "write one with `rlsched fit`"
        )
    if data.get("version") != VERSION:
        raise _bad(path, f"has version {data.get('version')!r}, this rlsched reads version {VERSION}")
    ops = data.get("ops")
    if not isinstance(ops, dict):
        raise _bad(path, "lacks field 'ops'")
    for op in ("verify", "prefill", "draft"):
        if op not in ops:
            raise _bad(path, f"lacks field 'ops.{op}'")
    for op in PER_DRAFTER:
        if not isinstance(ops.get(op, {}), dict):
            raise _bad(path, f"has no valid 'ops.{op}' (an object of drafter name -> fit expected)")
    _check_entry(path, "verify", "verify", ops["verify"])
    _check_entry(path, "prefill", "prefill", ops["prefill"])
    for op in PER_DRAFTER:
        for name, entry in ops.get(op, {}).items():
            _check_entry(path, f"{op}.{name}", op, entry)
    for op in OPTIONAL:
        if op in ops:
            _check_entry(path, op, op, ops[op])
            if ops[op]["used"] != "parametric":
                raise _bad(path, f"has 'ops.{op}.used' = {ops[op]['used']!r} (parametric expected)")
    data["_sha256"] = hashlib.sha256(raw).hexdigest()
    return data


def load_cost_model(path, base=None, drafters=()) -> FittedCostModel:
    """The CostModel of a `rlsched fit` file. `base` (the config's analytic model) supplies KV
    capacity and transfer; `drafters` (the config's drafter names) must all have a draft fit."""
    data = read_cost_file(path)
    missing = [d for d in drafters if d not in data["ops"]["draft"]]
    if missing:
        have = ", ".join(data["ops"]["draft"]) or "none"
        raise UserError(
            f"cost model file '{path}' has no draft fit for drafter(s) {', '.join(missing)} (it has: "
            f"{have}); name the config's drafters after the profiled ones or profile them"
        )
    try:
        return FittedCostModel(data, base, Path(path))
    except UserError as e:
        raise _bad(path, f"has an unusable grid ({e})") from None
