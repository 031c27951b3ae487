"""What a plan compares its winner with, like with like.

- **The workload's own setup at the winner's GPU count.** The own setup (the config as written:
  tp, batch limit, memory fraction, policy, placement) is scaled to the GPUs the winner holds:
  colocated, its instances of its tp fill them; split, its rollout and training GPUs keep their
  shares. Where that cannot be made in whole GPUs of its tp, or cannot run there, the plan says
  why instead of comparing setups on different GPU counts.
- **The best plain decoding setup at the winner's GPU count.**
- **Ties.** Every setup is simulated on the same seeds; a setup ties the winner when the seeds
  cannot tell them apart: it is as good as the winner on at least one seed, or its mean gap is
  within the spread of its per-seed gaps (largest minus smallest). One seed has no spread: only
  a setup as good on it ties.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlsched.config import SimConfig
from rlsched.plan.feasible import infeasible
from rlsched.plan.screen import score
from rlsched.plan.search import Ranked
from rlsched.plan.space import Candidate, from_config, to_config

if TYPE_CHECKING:
    from rlsched.plan.planner import Plan


def where(c: Candidate) -> str:
    """The candidate's placement, instances and GPUs, e.g. `colocated tp2x4 on 8 GPUs`."""
    return f"{c.placement} tp{c.tp}x{c.instances} on {c.gpus} GPUs"


def own_at(base: SimConfig, gpus: int) -> tuple[Candidate | None, str | None]:
    """(the workload's own setup on `gpus` GPUs, None) or (None, why it cannot be made there)."""
    own = from_config(base)
    if own.gpus == gpus:
        reason = infeasible(to_config(base, own))
        return (None, f"as written ({where(own)}) it cannot run: {reason}") if reason else (own, None)
    rollout, train = gpus, None
    if own.train_gpus is not None:
        if (own.rollout_gpus * gpus) % own.gpus:
            return None, f"its split {own.rollout_gpus}+{own.train_gpus} does not scale to {gpus} GPUs in whole GPUs"
        rollout = own.rollout_gpus * gpus // own.gpus
        train = gpus - rollout
        if rollout < 1 or train < 1:
            return None, f"its split {own.rollout_gpus}+{own.train_gpus} leaves no GPU to a stage on {gpus} GPUs"
    if rollout % own.tp:
        return None, f"its tp {own.tp} does not divide the {rollout} rollout GPUs of {gpus}"
    scaled = base.model_copy(
        update={
            "cluster": base.cluster.model_copy(update={"instances": rollout // own.tp}),
            "rl": base.rl.model_copy(update={"train_gpus": train}),
        }
    )
    c = from_config(scaled)  # colocated on fewer GPUs, its memory fraction may need training's states offloaded
    reason = infeasible(to_config(base, c))
    if reason is not None:
        return None, f"as {where(c)} it cannot run: {reason}"
    return c, None


def seed_scores(x: Ranked, objective: str) -> dict[int, float]:
    """The setup's score on each seed it ran."""
    c = x.candidate
    return {r["seed"]: score(objective, r["step_s"], c.gpus, r["tokens"]) for r in x.runs}


def gaps(x: Ranked, winner: Ranked, objective: str) -> list[float]:
    """`x`'s score over the winner's, minus 1, on each seed both ran (> 0: `x` is worse)."""
    a, w = seed_scores(x, objective), seed_scores(winner, objective)
    return [a[s] / w[s] - 1 for s in sorted(a) if s in w]


def is_tie(x: Ranked, winner: Ranked, objective: str) -> bool:
    """Whether the seeds cannot tell `x` from the winner (see the module's docstring)."""
    g = gaps(x, winner, objective)
    if not g:
        return False
    mean = x.score(objective) / winner.score(objective) - 1
    return min(g) <= 0 or mean <= max(g) - min(g)


def ties(plan: Plan) -> list[dict]:
    """The setups that ran every seed and tie the winner: [{setup, gap, seed_gaps}], best first."""
    w, n = plan.winner, len(plan.seeds)
    out = []
    for x in plan.ranked[1:]:
        if len(x.runs) == n and is_tie(x, w, plan.objective):
            out.append(
                {
                    "setup": x.candidate.label,
                    "gap": x.score(plan.objective) / w.score(plan.objective) - 1,
                    "seed_gaps": gaps(x, w, plan.objective),
                }
            )
    return out


def comparisons(plan: Plan) -> dict:
    """The summary's comparisons: ties, the best plain decoding and the own setup, each on the
    winner's GPUs, with a note where one cannot be made."""
    w, obj = plan.winner, plan.objective
    gpus = w.candidate.gpus
    tied = ties(plan)
    out: dict = {"ties": tied, "tie_count": len(tied)}
    if plan.baseline is not None:
        b = plan.baseline
        out.update(
            baseline=b.candidate.label,
            baseline_step_s=b.mean("step_s"),
            baseline_gpus=b.candidate.gpus,
            speedup_over_baseline=b.mean("step_s") / w.mean("step_s"),
            baseline_tie=b is not w and is_tie(b, w, obj),
        )
    else:
        out["baseline_note"] = f"no plain decoding setup on the winner's {gpus} GPUs ran every seed"
    written = from_config(plan.base)
    out.update(own_as_written=written.label, own_written_gpus=written.gpus)
    if plan.own is not None:
        o = plan.own
        out.update(
            own_setup=o.candidate.label,
            own_step_s=o.mean("step_s"),
            own_gpus=o.candidate.gpus,
            gain_over_own=o.score(obj) / w.score(obj) - 1,
            own_tie=o is not w and is_tie(o, w, obj),
        )
        if o.candidate.gpus != written.gpus:
            out["own_note"] = (
                f"the workload's own setup holds {written.gpus} GPUs ({where(written)}); compared on the winner's "
                f"{gpus} GPUs as {where(o.candidate)}"
            )
    else:
        why = plan.own_reasons.get(gpus, "it did not run every seed")
        out["own_note"] = f"no comparison with the workload's own setup on the winner's {gpus} GPUs: {why}"
    return out
