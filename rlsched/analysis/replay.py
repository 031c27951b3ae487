"""Replay a real run in the simulator: does the simulator predict what the executor did?

`replay_run(RUNDIR)` rebuilds each RL step's rollout from the run's own traces (every
sample's prompt and response length and the engine's estimate of its per-token acceptance),
simulates that step's generation stage with the run's batch limit, k_max and drafting policy
(on one instance, or on the run's instances with its reallocation policy; a `--backend vllm`
run's instances as the simulator's model of vLLM's engine, with the scheduling arguments of
its `traces/engine-*.json`), and sets the predicted time beside the measured one
(`generation_s` of the run's `rl_steps` records).

Step costs come from a `rlsched fit` file (`cost_file`) or, by default, are fitted from the
run's own step records (each op then scaled so that its fitted total equals its measured
total on those records: see `mean_calibration`). The executor also spends time between steps that no step record
covers (admitting and retiring rows, the policy's choice, trace records): the replay charges
it as a constant per engine step, measured from the run's step records as the median gap
between one step's end and the next one's start; and time before a rollout's first step and
after its last (handing requests over and outputs back), charged with every rollout as the
median over the run's RL steps (`outside_steps_s`). The drafting policy is priced as the run
priced it: with the run's own profile (`profile.parquet`) when the run took one, so that the
simulated policy makes the run's choices; the simulator charges the fitted costs.

An engine-core trace folder (rlsched's scheduler inside vLLM) is replayed window by window
by analysis/engine_replay.py; `replay_run` and `measured_generation_s` take either folder.

No torch: analysis/ runs without the executor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from rlsched.analysis.engine import is_engine_trace, run_engine
from rlsched.analysis.stage import simulate_stage
from rlsched.errors import UserError
from rlsched.policies.drafters import HOST_DRAFTERS
from rlsched.policies.registry import OFF_SPEC, parse_policy
from rlsched.traces.reader import read_profile, read_trace


@dataclass
class ReplayResult:
    steps: pd.DataFrame  # rl_step, measured_s, predicted_s, error (relative), predicted_off_s
    policy: str
    drafter: str | None
    overhead_ms: float
    cost: dict
    notes: list[str] = field(default_factory=list)
    kind: str = "run"  # run: a `rlsched run` folder's RL steps; engine: an engine-core trace's windows

    @property
    def mape(self) -> float:
        return float(np.mean(np.abs(self.steps["error"]))) * 100

    @property
    def worst(self) -> tuple[int, float]:
        i = int(np.argmax(np.abs(self.steps["error"].to_numpy())))
        return int(self.steps["rl_step"].iloc[i]), float(self.steps["error"].iloc[i]) * 100

    @property
    def predicted_speedup(self) -> float:
        """Predicted generation time with SD off over predicted time with the run's policy."""
        return float(self.steps["predicted_off_s"].sum() / self.steps["predicted_s"].sum())

    def summary(self) -> dict:
        step, err = self.worst
        return dict(
            kind=self.kind,
            policy=self.policy,
            drafter=self.drafter,
            rl_steps=len(self.steps),
            mape_pct=self.mape,
            worst_step=step,
            worst_error_pct=err,
            measured_generation_s=float(self.steps["measured_s"].sum()),
            predicted_generation_s=float(self.steps["predicted_s"].sum()),
            predicted_off_s=float(self.steps["predicted_off_s"].sum()),
            predicted_sd_speedup=self.predicted_speedup,
            overhead_ms_per_step=self.overhead_ms,
            cost=self.cost,
            notes=self.notes,
        )


class _AsRun:
    """A cost model as the run paid it: each op's time times its calibration factor, plus a
    constant per engine step (the executor's loop between steps) with each verify (every
    decode step verifies) and each prefill."""

    def __init__(self, cost, seconds: float, factors: dict | None = None):
        self._cost, self.seconds, self.factors = cost, seconds, factors or {}

    def __getattr__(self, name):
        return getattr(self._cost, name)

    def _f(self, key: str) -> float:
        return self.factors.get(key, 1.0)

    def verify_time(self, batch, q, ctx_tokens):
        return self._f("verify") * self._cost.verify_time(batch, q, ctx_tokens) + self.seconds

    def draft_time(self, drafter, batch, k, ctx_tokens, width=1):
        return self._f(f"draft:{drafter}") * self._cost.draft_time(drafter, batch, k, ctx_tokens, width)

    def prefill_time(self, n_tokens, sum_sq_tokens=None):
        return self._f("prefill") * self._cost.prefill_time(n_tokens, sum_sq_tokens) + self.seconds

    def mixed_time(self, batch, q, ctx_tokens, chunk_prefix, chunk_len):
        """(A mixed step: calibrated as verification is, or as prefill without rows.)"""
        f = self._f("verify") if batch > 0 else self._f("prefill")
        return f * self._cost.mixed_time(batch, q, ctx_tokens, chunk_prefix, chunk_len) + self.seconds

    @property
    def step_overhead(self) -> float:
        """The host's part of a step: the cost model's, and the time between steps."""
        return float(getattr(self._cost, "step_overhead", 0.0)) + self.seconds

    def drafter_prefill_time(self, drafter, n_tokens, sum_sq_tokens=None):
        """(Inside a drafting step: calibrated as the drafter's drafting is.)"""
        return self._f(f"draft:{drafter}") * self._cost.drafter_prefill_time(drafter, n_tokens, sum_sq_tokens)


def mean_calibration(fit, tables: dict | None = None) -> dict[str, float]:
    """Per fitted op: measured total over predicted total on its own records (or on
    `tables[op]`, the run's own where the fit also took others). The forms are
    fitted to log times (robust to the spikes of a shared machine), which predicts a step's
    typical time; a stage's time is the sum of its steps, whose mean the spikes raise. This
    factor (a smearing correction) puts the sum back."""
    out = {}
    for key, f in fit.ops.items():
        d = f.data if tables is None else tables.get(key, f.data)
        if f.used != "parametric" or d.empty:
            continue
        pred = np.asarray(f.predict_ms(d["batch"], d["tokens"], d["per_row"]), dtype=float)
        if np.isfinite(pred).all() and pred.sum() > 0:
            out[key] = float(d["ms"].sum() / pred.sum())
    return out


_ROLLOUT_COUNTS = ("prompts_per_step", "group_size", "max_tokens", "max_batch", "k_max")  # required, >= 1


def _check_run_config(cfg, cfg_file: Path) -> dict:
    """The fields of a run's config.yaml that a replay reads, checked: one UserError naming the
    file and the field."""
    from rlsched.policies.realloc import REALLOC_POLICIES

    fix = "restore the run's own config.yaml"
    if not isinstance(cfg, dict) or "rollout" not in cfg or "policy" not in cfg:
        raise UserError(f"{cfg_file} is not a run config (no 'rollout' or 'policy'); {fix}")
    r = cfg["rollout"]
    if not isinstance(r, dict):
        raise UserError(f"{cfg_file}: rollout is not a mapping; {fix}")

    def whole(v, least: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= least

    for key in (*_ROLLOUT_COUNTS, "instances", "realloc_threshold", "probe_every"):
        if key not in r and key in _ROLLOUT_COUNTS:
            raise UserError(f"{cfg_file}: rollout.{key} is missing; {fix}")
        if key in r and not whole(r[key], 1) and not (key == "probe_every" and r[key] is None):
            raise UserError(f"{cfg_file}: rollout.{key} is {r[key]!r}, not a whole number >= 1; {fix}")
    realloc = str(r.get("realloc", "none"))
    if realloc not in [n.strip() for n in REALLOC_POLICIES.split(",")]:
        raise UserError(f"{cfg_file}: rollout.realloc is {realloc!r}, not one of {REALLOC_POLICIES}; {fix}")
    if r.get("backend", "local") not in ("local", "vllm") or not isinstance(r.get("share_prompts", False), bool):
        raise UserError(f"{cfg_file}: rollout.backend or rollout.share_prompts is not a run's value; {fix}")
    if not isinstance(cfg["policy"], str) or not isinstance(cfg.get("drafter", "off"), str):
        raise UserError(f"{cfg_file}: policy and drafter must be names (text); {fix}")
    if not whole(cfg.get("seed", 0), 0):
        raise UserError(f"{cfg_file}: seed is {cfg.get('seed')!r}, not a whole number >= 0; {fix}")
    return cfg


def read_run(rundir: Path) -> tuple[dict, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(config, rl_steps, samples, steps) of a `rlsched run` folder, with one clear error."""
    rundir = Path(rundir)
    if not rundir.is_dir():
        raise UserError(
            f"run folder {rundir} does not exist; give the --out folder of a `rlsched run` or an engine-core "
            "trace folder"
        )
    cfg_file = rundir / "config.yaml"
    if not cfg_file.is_file():
        raise UserError(
            f"{rundir} is neither a `rlsched run` folder (no config.yaml) nor an engine-core trace folder "
            "(no engine-*.json)"
        )
    try:
        cfg = yaml.safe_load(cfg_file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise UserError(
            f"{cfg_file} is not valid YAML ({str(e).splitlines()[0]}); restore the run's own config.yaml"
        ) from None
    except OSError as e:
        raise UserError(f"{cfg_file} cannot be read ({e.strerror or e}); check the file") from None
    cfg = _check_run_config(cfg, cfg_file)
    traces = rundir / "traces"
    if not traces.is_dir():
        raise UserError(f"{rundir} has no traces/ folder; the run wrote nothing to replay")
    if not (traces / "samples").is_dir():
        raise UserError(
            f"{traces / 'samples'} is missing: a replay rebuilds each RL step's rollout from the run's sample "
            "records; restore that folder or replay another run"
        )
    rl, samples, steps = (read_trace(traces, kind) for kind in ("rl_steps", "samples", "steps"))
    if rl.empty:
        raise UserError(f"{traces}: no rl_steps records; the run finished no RL step")
    if samples.empty:
        raise UserError(f"{traces / 'samples'} holds no sample records; restore it from the run or replay another run")
    return cfg, rl, samples, steps


def measured_generation_s(folder) -> float:
    """Measured generation seconds of a run folder's RL steps, or of an engine-core trace's
    windows (each as long as its slowest engine's span of step records)."""
    folder = Path(folder)
    if is_engine_trace(folder):
        from rlsched.analysis.engine import read_engine_trace, windows

        tr = read_engine_trace(folder)
        return float(windows(tr.steps, tr.samples).groupby("rl_step")["measured_s"].max().sum())
    _, rl, _, _ = read_run(folder)
    return float(rl["generation_s"].sum())


def step_overhead_s(steps: pd.DataFrame) -> float:
    """Median gap between a step record's end and the next record's start, within a rollout
    of one instance (instances of a pool keep their own clocks)."""
    gaps = []
    keys = ["rl_step", "instance"] if "instance" in steps else ["rl_step"]
    for _, g in steps.sort_values([*keys, "time_s"]).groupby(keys):
        t, ms = g["time_s"].to_numpy(), g["step_ms"].to_numpy()
        if len(t) > 1:
            gaps.append(t[1:] - (t[:-1] + ms[:-1] / 1e3))
    return float(np.median(np.concatenate(gaps))) if gaps else 0.0


def outside_steps_s(rl: pd.DataFrame, steps: pd.DataFrame) -> float:
    """The median over RL steps of the generation stage's time outside its step records
    (before the first and after the last: handing requests to the engine and taking their
    outputs back, across processes where vLLM's engine core runs in its own), for a run of one
    instance; 0 where a pool's instances keep their own clocks."""
    if "instance" in steps and steps["instance"].nunique() > 1:
        return 0.0
    g = steps.sort_values("time_s").groupby("rl_step")
    span = g["time_s"].max() - g["time_s"].min() + g["step_ms"].last() / 1e3
    out = (rl.set_index("rl_step")["generation_s"] - span).dropna()
    return max(float(out.median()), 0.0) if len(out) else 0.0


def _rollout(samples: pd.DataFrame, drafter: str | None):
    from rlsched.sim.workload import Rollout

    s = samples.sort_values("sample_id")
    prompt_of = pd.factorize(s["prompt_id"])[0].astype(np.int64)
    names: tuple[str, ...]
    if drafter is not None:
        acc, names = per_sample_acceptance(s, drafter)[:, None], (drafter,)
    else:
        acc, names = np.zeros((len(s), 0)), ()
    return Rollout(prompt_of, s["prompt_len"].to_numpy(np.int64), s["response_len"].to_numpy(np.int64), acc, names)


def per_sample_acceptance(samples: pd.DataFrame, drafter: str, strength: float = 4.0) -> np.ndarray:
    """Each sample's per-token acceptance: from its own chain trials (accepted drafts, and
    rejections: steps that ended in one) shrunk towards the run's rate with `strength` trials;
    from the engine's estimate (acceptance_<drafter>) for traces without the trial counts."""
    if {"accepted", "rejected"} <= set(samples.columns):
        acc, rej = samples["accepted"].to_numpy(float), samples["rejected"].to_numpy(float)
        rate = acc.sum() / (acc.sum() + rej.sum()) if acc.sum() + rej.sum() > 0 else 0.6
        return (acc + rate * strength) / (acc + rej + strength)
    col = f"acceptance_{drafter}"
    return samples[col].to_numpy(dtype=float) if col in samples else np.full(len(samples), 0.6)


def _drafter_name(cfg: dict) -> str | None:
    d = str(cfg.get("drafter", "off"))
    return None if d == "off" else (d if d in HOST_DRAFTERS + ("eagle",) else "model")


def run_limits(run_cfg: dict, rollouts, engine: dict | None = None) -> dict:
    """What `simulate_stage` takes of a run's config: its instances, reallocation, batch limit,
    k_max, prompt sharing, probing, the longest response and the typical context the policy
    was built for; with `engine` (an `engine` section), the engine the instances run as."""
    r = run_cfg["rollout"]
    return dict(
        engine=engine,
        instances=int(r.get("instances", 1)),
        realloc=str(r.get("realloc", "none")),
        realloc_threshold=int(r.get("realloc_threshold", 8)),
        max_batch=int(r["max_batch"]),
        k_max=int(r["k_max"]),
        max_tokens=int(r["max_tokens"]),
        share_prompts=shares_prompts(run_cfg),
        probe_every=probes_every(run_cfg),
        typical_ctx=int(np.mean([ro.prompt_len.mean() for ro in rollouts]) + r["max_tokens"] / 2),
    )


def _simulate(rollouts, policy, drafter, sim_cost, policy_cost, run_cfg: dict, seed: int) -> list[float]:
    """Generation-stage seconds of each rollout with the run's limits (`run_limits`)."""
    return simulate_stage(rollouts, policy, drafter, sim_cost, policy_cost, run_limits(run_cfg, rollouts), seed)


def probes_every(run_cfg: dict) -> int | None:
    """How often the run's engine probed (`policies/probe.py`): `rollout.probe_every` of the
    local engine (a run config without the field never probed)."""
    r = run_cfg["rollout"]
    return r.get("probe_every") if r.get("backend", "local") == "local" else None


def shares_prompts(run_cfg: dict) -> bool:
    """Whether the run's engine shared a prompt's prefill among its samples: rlsched's own
    engine with `rollout.share_prompts` (a run config without the field did not)."""
    r = run_cfg["rollout"]
    return bool(r.get("share_prompts", False)) and r.get("backend", "local") == "local"


def _costs(rundir: Path, cost_file, drafter, steps: pd.DataFrame | None = None):
    """(the cost model, what it is, the policy's cost model, calibration factors: those of a
    fit of the run's own records, none for a given file).

    A run that drafted at every batch size it reached has no plain step to fit plain decoding
    from there (the form's u, the jump from one row to rows of different lengths, is then
    unknown and priced zero, so the off counterfactual comes out under what an off run
    takes). When the run profiled at its start (`profile.parquet`), its
    plain steps at two rows or more join the fit; the calibration factors stay those of the
    run's own records."""
    from rlsched.costs.costfile import FittedCostModel, load_cost_model
    from rlsched.costs.fit import fit_records, op_tables, read_records
    from rlsched.costs.measured import MeasuredCostModel

    factors = {}
    profile = rundir / "profile.parquet"
    borrowed = 0
    if cost_file is not None:
        cost = load_cost_model(cost_file, drafters=() if drafter is None else (drafter,))
        what: dict[str, Any] = {"source": str(cost_file)}
    else:
        df, source = read_records(rundir)
        own = None  # the run's own op tables, where the fit also takes the profile's
        if drafter is not None and steps is not None and profile.is_file() and _plain_steps_uncovered(steps):
            own, _ = op_tables(df)
            prof = read_profile(profile)
            plain = prof[(prof["kind"] == "verify") & (prof["k"] == 0) & (prof["batch"] >= 2)]
            df, borrowed = pd.concat([df, plain], ignore_index=True), len(plain)
        fit = fit_records(df, source)
        cost = FittedCostModel(fit.to_json(), path=rundir)
        factors = mean_calibration(fit, own)
        what = {"source": f"fitted from {rundir}/traces", "calibration": factors, **fit.summary()}
        if borrowed:
            what["borrowed_plain_steps"] = borrowed
    if isinstance(cost, MeasuredCostModel):
        cost.host_step = 0.0  # the time between steps is charged as this run measured it (`_AsRun`)
    policy_cost = MeasuredCostModel(read_profile(profile)) if profile.is_file() else cost
    return cost, what, policy_cost, factors


def replay_run(rundir, cost_file=None, policy: str | None = None) -> ReplayResult:
    """Predicted against measured generation time of every RL step of a run, or of every
    window of an engine-core trace folder (analysis/engine_replay.py)."""
    rundir = Path(rundir)
    if is_engine_trace(rundir):
        from rlsched.analysis.engine_replay import replay_engine

        return replay_engine(rundir, cost_file, policy)
    cfg, rl, samples, steps = read_run(rundir)
    drafter = _drafter_name(cfg)
    spec = policy or str(cfg["policy"])
    cost, what, policy_cost, factors = _costs(rundir, cost_file, drafter, steps)
    overhead = step_overhead_s(steps)
    sim_cost = _AsRun(cost, overhead, factors)
    rl = rl.sort_values("rl_step")
    lacking = sorted(set(rl["rl_step"]) - set(samples["rl_step"]))  # their sample records were lost
    rl = rl[~rl["rl_step"].isin(lacking)]
    if rl.empty:
        raise UserError(f"{rundir / 'traces' / 'samples'} holds no sample records of the run's RL steps")
    done = rl["rl_step"].tolist()
    rollouts = [_rollout(samples[samples["rl_step"] == s], drafter) for s in done]
    engine, more = run_engine(rundir, cfg)
    parsed, limits, seed = parse_policy(spec), run_limits(cfg, rollouts, engine), int(cfg.get("seed", 0))
    outside = outside_steps_s(rl, steps)  # charged with every rollout, as measured
    predicted = np.add(simulate_stage(rollouts, parsed, drafter, sim_cost, policy_cost, limits, seed), outside)
    predicted_off = np.add(simulate_stage(rollouts, OFF_SPEC, drafter, sim_cost, policy_cost, limits, seed), outside)
    measured = rl["generation_s"].to_numpy(dtype=float)
    df = pd.DataFrame(dict(rl_step=done, measured_s=measured, predicted_s=predicted, predicted_off_s=predicted_off))
    df["error"] = (df["predicted_s"] - df["measured_s"]) / df["measured_s"]
    notes = [f"RL step(s) {', '.join(map(str, lacking))} left out: no sample records"] if lacking else []
    notes += more
    if spec != str(cfg["policy"]):
        notes.append(f"replayed with policy {spec}; the run used {cfg['policy']}")
    if parsed.family == "bandit":
        notes.append("bandit learns from measured step times: its simulated choices differ from the run's")
    if what.get("borrowed_plain_steps"):
        notes.append(
            f"the run decoded without drafts only at small batches (or never): plain steps are priced "
            f"with its start-of-run profile's {what['borrowed_plain_steps']} plain steps at 2+ rows"
        )
    elif cost_file is None and drafter is not None and _plain_steps_uncovered(steps):
        notes.append(
            "the run decoded without drafts only at small batches (or never): its own fit prices SD off "
            "by extrapolation, so the predicted speedup over off is a guess; pass --cost with a profile's fit"
        )
    return ReplayResult(df, spec, drafter, overhead * 1e3, what, notes)


def _plain_steps_uncovered(steps: pd.DataFrame) -> bool:
    """Whether a run's plain decode steps (k = 0) miss the batch sizes it drafted at: a fit of
    its records then prices a plain step by extrapolating verification to one token a row,
    which can put the predicted speedup over off far from the real one."""
    dec = steps[steps["kind"] == "decode"]
    plain, drafted = dec[dec["k"] == 0], dec[dec["k"] > 0]
    return not drafted.empty and (plain.empty or plain["batch"].max() < drafted["batch"].max() / 2)


def replay_figure(result: ReplayResult):
    """Measured and predicted generation time per RL step, and the relative error."""
    from rlsched.analysis.plots import Figure

    df = result.steps
    x = "window (rl_step)" if result.kind == "engine" else "RL step"
    fig = Figure(figsize=(10, 3.6))
    ax = fig.add_subplot(1, 2, 1)
    ax.plot(df["rl_step"], df["measured_s"], marker=".", label="measured")
    ax.plot(df["rl_step"], df["predicted_s"], marker=".", label=f"simulated ({result.policy})")
    ax.set(xlabel=x, ylabel="generation stage (s)", title=f"replay: MAPE {result.mape:.1f}%")
    ax.legend()
    ax = fig.add_subplot(1, 2, 2)
    ax.bar(df["rl_step"], df["error"] * 100)
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set(xlabel=x, ylabel="(predicted - measured) / measured, %", title="error per step")
    fig.tight_layout()
    return fig


def sim_config_from_run(rundir, cost_file=None, steps: int = 3) -> dict:
    """A simulator config (raw, for `rlsched learn`/`compare --config`) of a run's workload:
    one instance with the run's batch limit and k_max, its prompts x group size, the prompt and
    response lengths it produced (empirical), the mean acceptance its drafter reached, and its
    step costs (`cost_file`, a `rlsched fit` file). The model and hardware presets only set
    KV capacity (given here) and the non-generation stages."""
    cfg, rl, samples, _ = read_run(rundir)
    r, drafter = cfg["rollout"], _drafter_name(cfg)
    drafters = []
    if drafter is not None:
        mean = float(per_sample_acceptance(samples, drafter).mean())
        host = drafter in HOST_DRAFTERS  # drafts on the host from earlier text: priced as the simulator's ngram
        drafters.append(
            {
                "name": drafter,
                "kind": "ngram" if host else ("eagle" if drafter == "eagle" else "model"),
                **({} if host else {"model": "qwen2.5-0.5b"}),
                "acceptance": {
                    "mean": round(min(max(mean, 0.01), 0.99), 4),
                    "prompt_concentration": 20,
                    "sample_concentration": 50,
                },
            }
        )
    prompt = [int(x) for x in samples["prompt_len"]]
    response = [max(1, int(x)) for x in samples["response_len"]]
    out = {
        "name": f"replay-of-{Path(rundir).name}",
        "hardware": "h100-sxm",
        "model": "qwen2.5-0.5b",
        "drafters": drafters,
        "workload": {
            "prompts": int(r["prompts_per_step"]),
            "samples_per_prompt": int(r["group_size"]),
            "prompt_len": {"dist": "empirical", "values": prompt},
            "response_len": {"dist": "empirical", "values": response, "max": int(r["max_tokens"])},
        },
        "cluster": {
            "instances": 1,
            "max_batch": int(r["max_batch"]),
            "kv_capacity_tokens": int(r["max_batch"]) * (max(prompt) + int(r["max_tokens"]) + 16) * 2,
            "share_prompts": shares_prompts(cfg),
        },
        "speculation": {
            "policy": "goodput" if drafters else "off",
            "k_max": int(r["k_max"]),
            "probe_every": probes_every(cfg),
        },
        "rl": {"steps": steps, "recompute_old_logprobs": False},
        "seed": int(cfg.get("seed", 0)),
    }
    if cost_file is not None:
        out["cost_file"] = str(cost_file)
    return out
