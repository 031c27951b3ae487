"""The guard against losing to plain decoding (`policies/guard.py`): it falls back where
drafting loses, within its stated bound; it leaves a policy whose drafting pays alone; it is
on by default for the adaptive families, and `:unguarded` turns it off."""

import pickle

import numpy as np
import pytest
from support import one_line_error, rlsched

from rlsched.config import load_config
from rlsched.errors import UserError
from rlsched.policies import guard as guard_module
from rlsched.policies.acceptance import AcceptanceEstimator
from rlsched.policies.draft import GoodputPolicy, PolicyContext
from rlsched.policies.guard import Guarded, unguarded
from rlsched.policies.registry import FAMILIES, Family, PolicySpec, make_draft_policy, parse_policy, usage
from rlsched.policies.types import OFF, EngineState, StepOutcome, Strategy
from rlsched.sim.simulate import policy_context, simulate


class Cost:
    """A hand-built cost model: a verify of q tokens a row costs 10 ms + 0.5 ms a token, a
    draft 2 ms a token drafted; a host drafter (no feed)."""

    def verify_time(self, batch, q, ctx_tokens):
        return 0.010 + 0.0005 * batch * np.asarray(q, dtype=float)

    def draft_time(self, drafter, batch, k, ctx_tokens, width=1):
        return 0.002 * np.asarray(k, dtype=float)

    def draft_time_per_row(self, drafter, ks, ctx_tokens):
        return 0.002 * np.asarray(ks).max(axis=-1)

    def prefill_time(self, n_tokens, sum_sq_tokens=None):
        return 0.0

    def drafter_prefill_time(self, drafter, n_tokens, sum_sq_tokens=None):
        return 0.0

    def kv_transfer_time(self, ctx_tokens, n_seqs):
        return 0.0


class Fixed:
    """A fake adaptive policy: a chain of k = 1 + step % k_cycle every step but those that are
    multiples of `off_every`."""

    name = "fixed"
    needs_acceptance = True

    def __init__(self, observes: bool, k_cycle: int = 4, off_every: int = 0):
        self.observes, self.k_cycle, self.off_every = observes, k_cycle, off_every
        self.seen = 0

    def choose(self, state):
        if self.off_every and state.step % self.off_every == 0:
            return OFF
        return Strategy("model", 1 + state.step % self.k_cycle)

    def observe(self, outcome):
        self.seen += 1


def drive(policy, acceptance: float, steps: int, batch: int = 32, seed: int = 0):
    """A fixed batch decoded `steps` steps under `policy`, priced by `Cost` with per-token
    acceptance `acceptance`: (seconds, tokens, each step's strategy)."""
    cost, rng = Cost(), np.random.default_rng(seed)
    est = AcceptanceEstimator(["model"], prior_mean=acceptance)
    est.begin_rollout(batch, np.arange(batch))
    ids, ctx = np.arange(batch), np.full(batch, 100)
    now, tokens, chosen = 0.0, 0, []
    for step in range(steps):
        state = EngineState(0, step, now, ids, ctx, int(ctx.sum()), 0, 10**9, est)
        s = policy.choose(state)
        chosen.append(s)
        if s.is_off:
            dt, acc = float(cost.verify_time(batch, 1, 0)), np.zeros(batch, dtype=np.int64)
        else:
            acc = np.minimum(rng.geometric(1 - acceptance, batch) - 1, s.k)
            dt = float(cost.draft_time("model", batch, s.k, 0) + cost.verify_time(batch, s.k + 1, 0))
        emitted = int(acc.sum()) + batch
        if getattr(policy, "observes", True):
            policy.observe(StepOutcome(0, step, s, batch, batch * s.k, emitted - batch, emitted, dt, 0.0, dt, ids, acc))
        now, tokens = now + dt, tokens + emitted
        ctx = ctx + acc + 1
    return now, tokens, chosen


CTX = PolicyContext(cost=Cost(), drafters=("model",), k_max=4)
V1 = 0.010 + 0.0005 * 32  # a plain step of 32 rows


@pytest.mark.parametrize("observes", [True, False], ids=["observing", "choose-view"])
def test_the_guard_falls_back_where_drafting_loses_within_its_bound(observes):
    """At acceptance 0.3 every chain loses to plain decoding (k = 4: 2.2 ms a token against
    0.8); unguarded, the fake drafts every step. Guarded, it falls back, and its time exceeds
    plain decoding's for the same tokens by at most the stated bound: the books' bound plus,
    per back-off, the one step that resumes drafting (outside the books)."""
    bare_time, _, _ = drive(Fixed(observes), 0.3, 4000)
    guard = Guarded(Fixed(observes), CTX)
    time, tokens, chosen = drive(guard, 0.3, 4000)
    plain = tokens * V1 / 32
    assert guard.backoffs >= 3 and sum(s.is_off for s in chosen) > 3000
    assert guard.realised_s - guard.plain_s <= guard.regret_bound
    resume = float(Cost().draft_time("model", 32, 4, 0) + Cost().verify_time(32, 5, 0))
    assert time - plain <= guard.regret_bound + (guard.backoffs + 1) * resume
    assert time < 0.5 * bare_time  # (unguarded: 2.2x plain decoding)
    assert guard.inner.seen == (4000 if observes else 0)  # every outcome reached the inner policy


@pytest.mark.parametrize("observes", [True, False], ids=["observing", "choose-view"])
def test_the_guard_leaves_a_paying_policy_alone(observes):
    """At acceptance 0.9 every chain pays (k = 1: 0.62 ms a token against 0.81); the guarded
    fake makes the very choices the bare one makes, off steps and resumptions included."""
    bare = drive(Fixed(observes, off_every=7), 0.9, 3000)
    guard = Guarded(Fixed(observes, off_every=7), CTX)
    held = drive(guard, 0.9, 3000)
    assert held[2] == bare[2] and held[0] == bare[0]
    assert guard.backoffs == 0 and guard.booked_steps > 2000 and guard.realised_s < guard.plain_s


def test_the_guard_keeps_the_simulators_steady_runs_and_the_inner_policys_face():
    ctx = policy_context(load_config("default"), Cost())
    goodput = make_draft_policy("goodput", ctx)
    assert isinstance(goodput, Guarded) and isinstance(unguarded(goodput), GoodputPolicy)
    assert goodput.name == "goodput" and goodput.needs_acceptance and goodput.observes is False
    assert make_draft_policy("bandit", ctx).observes is True  # bandit observes: so does its guard
    two = make_draft_policy("twostate:32:3", ctx)
    assert isinstance(two, Guarded) and (two.max_batch_on, two.k) == (32, 3)  # the inner policy's
    again = pickle.loads(pickle.dumps(goodput))  # (the vLLM engine ships its policy pickled)
    assert isinstance(again, Guarded) and again.name == "goodput"


def test_the_off_switch_parses_and_only_the_adaptive_families_are_guarded():
    ctx = policy_context(load_config("default"), Cost())
    for text in ("goodput", "goodput:drain", "seqgoodput", "twostate", "bandit:0.2", "table:p.json", "p.json"):
        spec = parse_policy(text)
        bare = parse_policy(text + ":unguarded")
        assert spec.guarded and not bare.guarded and bare.text == text + ":unguarded"
        assert (bare.family, bare.file, bare.drain, bare.epsilon) == (spec.family, spec.file, spec.drain, spec.epsilon)
    assert not isinstance(make_draft_policy("goodput:drain:unguarded", ctx), Guarded)
    assert make_draft_policy("goodput:drain:unguarded", ctx).name == "goodput"
    for text in ("off", "static:2", "tree:2:2:3", "oracle", "oracle:seq"):
        assert not parse_policy(text).guarded
    assert not isinstance(make_draft_policy("static:2", ctx), Guarded)
    assert ":unguarded" in usage("simulator") and ":unguarded" in usage("vllm")


@pytest.mark.parametrize(
    "text, message",
    [
        ("static:4:unguarded", "static runs unguarded"),
        ("off:unguarded", "off runs unguarded"),
        ("oracle:unguarded", "oracle runs unguarded"),
        ("goodput:unguarded:unguarded", ":unguarded is given twice"),
        ("goodput:unguardedx", "refresh interval"),
        (":unguarded", "unknown policy"),
    ],
)
def test_a_misplaced_off_switch_is_one_line(text, message):
    with pytest.raises(UserError) as e:
        parse_policy(text)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_cli_refuses_a_bad_suffix_in_one_line(tmp_path):
    proc = rlsched("simulate", "--policy", "static:2:unguarded", "--out", str(tmp_path / "o"), cwd=tmp_path)
    one_line_error(proc, "static:2:unguarded", ":unguarded")
    assert not (tmp_path / "o").exists()


class Optimist(GoodputPolicy):
    """`goodput` that believes every row accepts 0.85 (a wrong prior that never learns)."""

    name = "optimist"

    def _acceptance(self, state, drafter):
        return np.full(state.batch, 0.85)


def test_a_guarded_policy_with_a_wrong_prior_is_within_the_bound_of_off(monkeypatch):
    """On the low-acceptance preset (acceptance 0.3), cut small, a goodput that believes 0.85
    drafts on and runs 1.7x plain decoding's time; guarded, each instance's books hold the
    bound, and the stage is not more than the bound slower than off: margin x its time plus,
    per back-off, one window's loss (the books' bound, with the margin taken on the whole stage
    for what the books leave out: catch-ups, and the batch sizes the drain runs at)."""
    parse, build = (lambda text, arg: PolicySpec(text, "optimist")), (lambda p, ctx, words: Optimist(ctx))
    family = Family("optimist", "optimist", "goodput at 0.85", parse, build, guarded=True)
    monkeypatch.setitem(FAMILIES, "optimist", family)
    guards: list[Guarded] = []

    class Recorded(Guarded):
        def __init__(self, inner, ctx):
            super().__init__(inner, ctx)
            guards.append(self)

    monkeypatch.setattr(guard_module, "Guarded", Recorded)
    cfg = load_config("low-acceptance", overrides=["rl.steps=1", "workload.prompts=8"])
    cfg = cfg.model_copy(update={"record_timeline": False})
    off = simulate(cfg, "off").records[0].generation_s
    bare = simulate(cfg, "optimist:unguarded").records[0].generation_s
    guards.clear()
    held = simulate(cfg, "optimist").records[0].generation_s
    ran = [g for g in guards if g.booked_steps]
    assert len(ran) == cfg.cluster.instances and all(g.backoffs >= 1 for g in ran)
    for g in ran:
        assert g.realised_s - g.plain_s <= g.regret_bound
    per_backoff = max(g.regret_bound - g.margin * g.plain_s for g in ran)  # (back-offs + 1) x one window's loss
    bound = guard_module.MARGIN * off + per_backoff
    assert held - off <= bound < bare - off
