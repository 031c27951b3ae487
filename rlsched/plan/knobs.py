"""vLLM's own engine knobs as a planner searches them, where the config runs `engine.kind: vllm`
(the simulator's model of vLLM V1's engine, `sim/vllm_engine.py`).

Three knobs change what that engine does with a step:

- `max_num_batched_tokens` (the token budget of a step): the space's values (default 2048,
  4096, 8192, 16384) and the config's own. vLLM refuses a budget below `max_num_seqs`, and,
  with chunked prefill off, below the longest sequence (`max_model_len`): such values are not
  tried. A budget that holds every token a step could ever schedule (each of `max_num_seqs`
  rows its token, its drafts and its whole prompt) never throttles: of the budgets that do,
  only the smallest is tried, as they all run alike;
- `enable_chunked_prefill` on and off; off only where the budget holds the longest sequence,
  and not tried where the budget never runs short (no prompt is ever cut, so both run alike);
- `cudagraph_capture_sizes`: vLLM's default grid (`engine_config.default_capture_sizes`), a
  dense grid (1, 2, 3, then every 4 tokens, to the same largest size: a verify step of b rows
  and k drafts holds b x (k + 1) tokens, which the default grid pads by up to 15), and the
  config's own list. Not searched where the config runs eagerly (`[]`, enforce_eager). A larger
  largest size is not tried: the engine model runs a step above the largest size eagerly at its
  own count, with no launch cost, so capturing it would only add padding there.

A grid that resolves to the same sizes as an earlier one for a setup (a small batch limit) is
not tried twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlsched.config import SimConfig, length_max
from rlsched.engine_config import VLLM_MAX_CAPTURE, default_capture_sizes

BATCHED_TOKENS = (2048, 4096, 8192, 16384)  # around vLLM's defaults of 8192 and 16384
CAPTURES = ("vllm", "dense")  # the grids searched beside the config's own list


@dataclass(frozen=True)
class EngineKnobs:
    """One setting of vLLM's knobs: the token budget, chunked prefill, and the capture grid by
    name (`vllm`: vLLM's default, `dense`, `own`: the config's list, `eager`: none) with its
    sizes (None: vLLM's default grid)."""

    batched_tokens: int
    chunked_prefill: bool = True
    capture: str = "vllm"
    sizes: tuple[int, ...] | None = None

    @property
    def label(self) -> str:
        chunked = "" if self.chunked_prefill else " no-chunked-prefill"
        graphs = "" if self.capture == "vllm" else f" graphs:{self.capture}"
        return f"tokens{self.batched_tokens}{chunked}{graphs}"

    def engine_update(self) -> dict:
        """The `engine` section's fields this setting sets."""
        return dict(
            max_num_batched_tokens=self.batched_tokens,
            enable_chunked_prefill=self.chunked_prefill,
            cudagraph_capture_sizes=None if self.sizes is None else list(self.sizes),
        )


def dense_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """1, 2, 3, then every 4 tokens up to vLLM's default largest size (min(2 x max_num_seqs,
    512, the budget)), with that size and max_num_seqs."""
    top = min(2 * max_num_seqs, VLLM_MAX_CAPTURE, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 3) if s <= top] + list(range(4, top + 1, 4))
    sizes += [s for s in (top, max_num_seqs) if s <= top]
    return sorted(set(sizes))


def default_budget(cfg: SimConfig) -> int:
    """The config's token budget, vLLM's default for its GPU where it sets none."""
    hw = cfg.engine.resolve(cfg.hardware.memory_gib, cfg.hardware.name, cfg.cluster.max_batch, False)
    return hw.max_num_batched_tokens


def own_knobs(cfg: SimConfig) -> EngineKnobs | None:
    """The config's own setting (None under rlsched's engine)."""
    e = cfg.engine
    if e.kind != "vllm":
        return None
    sizes = e.cudagraph_capture_sizes
    capture = "vllm" if sizes is None else "eager" if not sizes else "own"
    return EngineKnobs(default_budget(cfg), e.enable_chunked_prefill, capture, None if sizes is None else tuple(sizes))


def step_tokens_max(cfg: SimConfig, max_batch: int, width: int) -> int:
    """The most tokens a step could schedule: each of `max_batch` rows its token, its drafts
    (a tree's nodes where trees are drafted) and its whole prompt."""
    s = cfg.speculation
    drafts = (s.nodes_max if width > 1 else s.k_max) if cfg.drafters else 0
    return max_batch * (1 + drafts + length_max(cfg.workload.prompt_len))


def _grids(cfg: SimConfig, captures: tuple[str, ...], max_batch: int, budget: int) -> list[tuple[str, tuple | None]]:
    """(name, sizes) of the grids to try for a setup: those named, then the config's own list;
    each only where it resolves to sizes no earlier one has."""
    given = cfg.engine.cudagraph_capture_sizes
    if given is not None and not given:
        return [("eager", ())]
    out, seen = [], set()
    for name in [*captures, *(["own"] if given is not None else [])]:
        sizes = tuple(given or ()) if name == "own" else None
        if name == "dense":
            sizes = tuple(dense_capture_sizes(max_batch, budget))
        grid = default_capture_sizes(max_batch, budget) if sizes is None else sizes
        resolved = tuple(s for s in grid if s <= budget)
        if resolved not in seen:
            seen.add(resolved)
            out.append((name, sizes))
    return out


def engine_options(
    cfg: SimConfig,
    max_batch: int,
    width: int,
    longest: int,
    budgets: tuple[int, ...] = BATCHED_TOKENS,
    chunked: tuple[bool, ...] = (True, False),
    captures: tuple[str, ...] = CAPTURES,
) -> list[EngineKnobs | None]:
    """The settings of vLLM's knobs to try for a setup of `max_batch` and tree `width` (module
    docstring); [None] under rlsched's engine. `longest`: the workload's longest sequence."""
    own = own_knobs(cfg)
    if own is None:
        return [None]
    tried = sorted({b for b in (*budgets, own.batched_tokens) if b >= max_batch})
    need = step_tokens_max(cfg, max_batch, width)
    covering = [b for b in tried if b >= need]
    tried = [b for b in tried if b < need] + covering[:1]
    out: list[EngineKnobs | None] = []
    for b in tried:
        modes = {*chunked, own.chunked_prefill} if b < need else {True}
        for on in sorted(modes, reverse=True):
            if not on and b < longest:
                continue
            out += [EngineKnobs(b, on, name, sizes) for name, sizes in _grids(cfg, captures, max_batch, b)]
    return out


def reference_knobs(cfg: SimConfig, settings: list[EngineKnobs], need: int) -> EngineKnobs:
    """Of a setup's `settings`, the one nearest what vLLM runs where its knobs are left out:
    its default budget for the GPU (or the setup's budget that, like it, never throttles at
    `need` tokens a step), chunked prefill on, its default grid (eager where the config is)."""
    hw = cfg.hardware
    default = type(cfg.engine)(kind="vllm").resolve(hw.memory_gib, hw.name, 1, False).max_num_batched_tokens
    grid = "eager" if cfg.engine.cudagraph_capture_sizes == [] else "vllm"
    return min(
        settings,
        key=lambda k: (k.capture != grid, not k.chunked_prefill, abs(min(k.batched_tokens, need) - min(default, need))),
    )
