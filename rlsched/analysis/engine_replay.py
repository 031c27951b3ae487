"""Replay an engine-core trace in the simulator: does the simulator predict what vLLM ran?

Each engine (an `engine-<tag>.json` and its parts) is an instance. For each of its windows
(`rl_step`: what it ran between two weight updates), the rollout is rebuilt from the window's
sample records (prompt and response lengths, each sample's acceptance from its own trials)
and the engine's windows are simulated one after another on one instance with the engine's
policy, batch limit (`max_num_seqs`), k_max (`num_speculative_tokens`) and probe interval, so
that the acceptance estimates carry over windows as in the engine. The instance runs as the
simulator's model of vLLM's engine (`engine.kind: vllm`) with the scheduling arguments the
engine file records (token budget, chunked prefill, prefix caching, async scheduling; no
CUDA graphs under enforce_eager), vLLM's defaults for those it lacks. A window's measured
time is the span of its step records on that engine's clock; over engines, a window takes as
long as its slowest engine, measured and predicted alike.

Step costs: a `rlsched fit` file, or a fit of the folder's own step records (calibrated as
`replay.py` does); the engine's time between steps is charged per step as measured. The
policy is priced as the engine priced it where its cost file is at hand, else by the
replay's costs (a note says so). What the trace cannot tell (request arrivals, RL stage
times) is said in the result's notes.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

from rlsched.analysis.engine import (
    UNKNOWN,
    EngineTrace,
    engine_section,
    read_engine_trace,
    untimed_notes,
    windows,
)
from rlsched.analysis.replay import (
    ReplayResult,
    _AsRun,
    _costs,
    _plain_steps_uncovered,
    _rollout,
    step_overhead_s,
)
from rlsched.analysis.stage import simulate_stage
from rlsched.errors import UserError
from rlsched.policies.registry import OFF_SPEC, parse_policy


def _drafter(tr: EngineTrace) -> str | None:
    """The drafter most engines ran, by the name their records give it (None: none drafted)."""
    names = Counter(e.get("name", e["drafter"]) for e in tr.engines if e["drafter"] != "off")
    return names.most_common(1)[0][0] if names else None


def _limits(engine: dict, rollouts) -> dict:
    """`simulate_stage`'s limits of one engine: vLLM's settings as its engine file holds them,
    the engine run as the simulator's model of vLLM's (`engine_section`)."""
    longest = max(int(ro.response_len.max()) for ro in rollouts)
    max_len = engine.get("max_len")
    typical = (
        int(max_len) // 2
        if isinstance(max_len, int) and max_len > 0
        else int(np.mean([ro.prompt_len.mean() for ro in rollouts]) + longest / 2)
    )
    return dict(
        instances=1,
        realloc="none",
        realloc_threshold=8,
        max_batch=engine["max_batch"],
        k_max=max(engine["k_max"], 1),
        max_tokens=max(longest, 1),
        share_prompts=False,  # (the vLLM engine model's own prefix caching)
        probe_every=engine["rlsched"].get("probe_every"),
        typical_ctx=max(typical, 1),
        engine=engine_section(engine),
    )


def _policy_cost(tr: EngineTrace, spec, drafter, cost, notes: list[str]):
    """The cost model the engines priced their policy with, where this machine has its file;
    else the replay's own (with a note)."""
    from rlsched.costs.costfile import load_cost_model

    if not spec.priced:
        return cost
    named = {e["rlsched"].get("cost_model") for e in tr.engines} - {None}
    if len(named) == 1:
        text = named.pop()
        if text.endswith(".json") and Path(text).is_file():
            try:
                return load_cost_model(Path(text), drafters=() if drafter is None else (drafter,))
            except UserError as e:
                notes.append(f"the engine's cost model {text} is unusable here ({e}); the policy is priced as replayed")
                return cost
        notes.append(
            f"the engine priced its policy with {text!r}, which this replay cannot rebuild here (a missing file, "
            "or a hardware preset's roofline of the served model): the replayed policy is priced by the replay's costs"
        )
    return cost


def _fit_costs(path: Path, cost_file, drafter, steps: pd.DataFrame):
    try:
        return _costs(path, cost_file, drafter, steps)
    except UserError as e:
        if cost_file is not None:
            raise
        raise UserError(
            f"replay: the step records of '{path}' cannot price steps ({str(e).removeprefix('fit: ')}); "
            "pass --cost with a `rlsched fit` file of the engine's model and hardware"
        ) from None


def _simulate_engines(tr, spec, drafter, sim_costs, policy_cost, done) -> pd.DataFrame:
    """Predicted seconds (the policy's, and with SD off) per engine and window."""
    rows = []
    for e in tr.engines:
        mine = tr.samples[tr.samples["engine"] == e["tag"]]
        steps = [w for w in done if (mine["rl_step"] == w).any()]
        if not steps:
            continue
        rollouts = [_rollout(mine[mine["rl_step"] == w], drafter) for w in steps]
        limits, seed = _limits(e, rollouts), int(e["rlsched"].get("seed", 0) or 0)
        sim = sim_costs[e["tag"]]
        e_spec = spec if e["drafter"] != "off" else OFF_SPEC
        predicted = simulate_stage(rollouts, e_spec, drafter, sim, policy_cost, limits, seed)
        off = simulate_stage(rollouts, OFF_SPEC, drafter, sim, policy_cost, limits, seed)
        rows += [
            dict(engine=e["tag"], rl_step=w, predicted_s=p, predicted_off_s=o) for w, p, o in zip(steps, predicted, off)
        ]
    return pd.DataFrame(rows)


def replay_engine(path, cost_file=None, policy: str | None = None) -> ReplayResult:
    """Predicted against measured generation time of every window of an engine-core trace."""
    path = Path(path)
    tr = read_engine_trace(path)
    if tr.samples.empty:
        raise UserError(
            f"'{path / 'samples'}' holds no sample records: a replay rebuilds each window's rollout from them "
            "(the engine finished no request, or the parts were moved)"
        )
    if tr.steps.empty:
        raise UserError(
            f"'{path / 'steps'}' holds no step records: a replay measures each window by them and fits step costs "
            "to them; restore the folder"
        )
    drafter = _drafter(tr)
    engine_policies = sorted({e["rlsched"]["policy"] for e in tr.engines})
    spec = policy or engine_policies[0]
    parsed = parse_policy(spec, "vllm")
    notes: list[str] = [UNKNOWN + ": the replay compares the generation stage alone"]
    notes.append(
        "requests' arrival times are not recorded: each window's samples start at once in the simulation, and "
        "its measured time (the span of its step records) includes any wait for requests in between"
    )
    cost, what, own_policy_cost, factors = _fit_costs(path, cost_file, drafter, tr.steps)
    if cost_file is None:
        what["source"] = f"fitted from {path / 'steps'}"
    policy_cost = _policy_cost(tr, parsed, drafter, own_policy_cost, notes)
    overheads = {e["tag"]: max(step_overhead_s(tr.steps[tr.steps["engine"] == e["tag"]]), 0.0) for e in tr.engines}
    sim_costs = {tag: _AsRun(cost, s, factors) for tag, s in overheads.items()}
    measured = windows(tr.steps, tr.samples)
    lacking = sorted(set(measured["rl_step"]) - set(tr.samples["rl_step"]))
    done = sorted(set(measured["rl_step"]) & set(tr.samples["rl_step"]))
    if not done:
        raise UserError(f"'{path}': no window has both step and sample records to replay")
    per = _simulate_engines(tr, parsed, drafter, sim_costs, policy_cost, done)
    per = per.merge(measured, on=["engine", "rl_step"], how="left")
    g = per.groupby("rl_step")
    df = pd.DataFrame(
        dict(
            rl_step=done,
            engines=g["engine"].nunique().loc[done].to_numpy(),
            samples=g["samples"].sum().loc[done].to_numpy(),
            measured_s=g["measured_s"].max().loc[done].to_numpy(),
            predicted_s=g["predicted_s"].max().loc[done].to_numpy(),
            predicted_off_s=g["predicted_off_s"].max().loc[done].to_numpy(),
        )
    )
    df["error"] = (df["predicted_s"] - df["measured_s"]) / df["measured_s"]
    if lacking:
        notes.append(f"window(s) {', '.join(map(str, lacking))} left out: step records but no sample records")
    if len(engine_policies) > 1 and policy is None:
        notes.append(f"the engines ran policies {', '.join(engine_policies)}: replayed with {spec}")
    elif policy is not None and policy not in engine_policies:
        notes.append(f"replayed with policy {spec}; the engine used {', '.join(engine_policies)}")
    if parsed.family == "bandit":
        notes.append("bandit learns from measured step times: its simulated choices differ from the engine's")
    notes += untimed_notes(tr.steps) + tr.notes
    if cost_file is None and drafter is not None and _plain_steps_uncovered(tr.steps):
        notes.append(
            "the engine decoded without drafts only at small batches (or never): its own fit prices SD off "
            "by extrapolation, so the predicted speedup over off is a guess; pass --cost with a profile's fit"
        )
    overhead_ms = float(np.mean(list(overheads.values()))) * 1e3
    return ReplayResult(df, spec, drafter, overhead_ms, what, notes, kind="engine")
