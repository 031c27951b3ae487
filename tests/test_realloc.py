"""Sample reallocation: conservation under migration, charged costs, freed instances, the
policies' decisions on hand-built views, and rebalance's gain on uneven loads."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from rlsched.config import load_config
from rlsched.costs.roofline import RooflineCostModel
from rlsched.errors import UserError
from rlsched.policies.realloc import Consolidate, NoRealloc, Rebalance, make_realloc_policy, split_kv_reprefill
from rlsched.policies.types import InstanceView, Migration, ReallocEvent
from rlsched.sim.cluster import GenerationStage
from rlsched.sim.instance import Instance
from rlsched.sim.simulate import simulate

SMALL = ["workload.prompts=8", "cluster.max_batch=32"]  # 512 samples, 128 per instance: queues 3x the batch


@pytest.fixture(scope="module")
def cost():
    return RooflineCostModel.from_config(load_config("uneven-load"))


# ---------------------------------------------------------------------- in the simulator
def run_checked(monkeypatch, cfg, policy, realloc):
    """Simulate while checking that a sample is never held by two instances (nor twice by one)
    when it arrives anywhere, and counting how often each sample finishes."""
    finishes = Counter()
    events = []
    receive, finished, report = Instance.receive, GenerationStage.finished, GenerationStage.report

    def checked_receive(self, ids, front=False):
        ids = [int(s) for s in ids]
        assert len(set(ids)) == len(ids)
        for inst in getattr(self.stage, "instances", []):
            held = set(inst.sid.tolist()) | set(inst.waiting)
            assert not held & set(ids), f"samples {sorted(held & set(ids))[:5]} on two instances"
        receive(self, ids, front)

    def counted_finished(self, inst, ids):
        finishes.update(ids.tolist())
        finished(self, inst, ids)

    def checked_report(self, inst, kind):
        if self.realloc_active and not self.done.triggered:
            views = self.views()
            listed = [int(s) for v in views for s in (*v.running_ids.tolist(), *v.waiting_ids)]
            assert len(listed) == len(set(listed)), "a sample in two views"
            assert all(v.running_remaining_hint is None for v in views)  # no oracle for the policy
            events.append(kind)
        report(self, inst, kind)

    monkeypatch.setattr(Instance, "receive", checked_receive)
    monkeypatch.setattr(GenerationStage, "finished", counted_finished)
    monkeypatch.setattr(GenerationStage, "report", checked_report)
    res = simulate(cfg, policy, realloc)
    n = res.records[0].stage.rollout.n
    assert sorted(finishes) == list(range(n)) and set(finishes.values()) == {1}  # each finishes exactly once
    return res, events


def assert_tokens_conserved(res):
    tl, samples = res.timeline_frame(), res.samples_frame()
    assert tl[tl.kind == "decode"].emitted.sum() == samples.response_len.sum()
    assert samples.finish_s.notna().all() and (samples.instance >= 0).all()


@pytest.mark.parametrize("realloc", ["rebalance", "consolidate"])
@pytest.mark.parametrize("policy", ["static:3", "goodput"])
def test_migration_loses_and_duplicates_no_tokens(monkeypatch, realloc, policy):
    cfg = load_config("uneven-load", overrides=SMALL)
    res, events = run_checked(monkeypatch, cfg, policy, realloc)
    assert_tokens_conserved(res)
    st = res.records[0].stage
    assert res.summary()["migrations"] == sum(m[3] for m in st.migration_log) > 0
    assert int(st.migrations.sum()) == res.summary()["migrations"]
    assert {"finished", "drained", "idle"} <= set(events)  # asked again after the first drain
    assert not st._in_motion and not any(st._incoming)  # everything that left arrived


def test_kv_transfers_take_time_and_delay_the_moved_samples(cost):
    res = simulate(load_config("uneven-load", overrides=SMALL), "static:3", "rebalance")
    log = res.records[0].stage.migration_log
    kv = [m for m in log if m[5] == "kv"]
    assert kv, "running sequences moved"
    for _, _, _, n, ctx, _, seconds in kv:
        assert seconds > 0 and seconds == pytest.approx(cost.kv_transfer_time(ctx, n))
    assert all(m[6] == 0 for m in log if m[5] == "tokens")  # queued samples move free


def test_reprefill_is_chosen_when_the_link_is_slow_and_charged_at_the_destination(monkeypatch):
    cfg = load_config("uneven-load", overrides=SMALL + ["hardware.migrate_link_gbs=0.01"])
    res, _ = run_checked(monkeypatch, cfg, "static:3", "rebalance")
    assert_tokens_conserved(res)
    log = res.records[0].stage.migration_log
    assert {m[5] for m in log} == {"tokens", "reprefill"}
    tl = res.timeline_frame()
    moved = sum(m[4] for m in log if m[5] == "reprefill")
    # prefill steps recompute every prompt once, plus each re-prefilled context
    assert tl[tl.kind == "prefill"].ctx_tokens.sum() == res.samples_frame().prompt_len.sum() + moved


def test_split_kv_reprefill_per_sequence(cost):
    ctx = np.array([50, 3000, 8000])
    assert split_kv_reprefill(cost, ctx) == 0  # fast link: ship every KV cache
    slow = RooflineCostModel.from_config(load_config("uneven-load", overrides=["hardware.migrate_link_gbs=0.05"]))
    assert split_kv_reprefill(slow, ctx) == 3
    # a link between the two: recomputing short contexts beats shipping them, not a long one
    # (prefill attention grows with the square of the length)
    mid = RooflineCostModel.from_config(load_config("uneven-load", overrides=["hardware.migrate_link_gbs=2"]))
    assert split_kv_reprefill(mid, np.array([300] * 50 + [60000])) == 50


def test_consolidate_frees_instances_that_then_stay_idle(monkeypatch):
    cfg = load_config("uneven-load", overrides=SMALL)
    res, _ = run_checked(monkeypatch, cfg, "static:3", "consolidate")
    assert_tokens_conserved(res)
    s, st = res.summary(), res.records[0].stage
    assert s["freed_gpu_s"] > 0
    freed = np.flatnonzero(~np.isnan(st.freed_at))
    assert len(freed) >= 1
    expect = sum(st.makespan - st.freed_at[i] for i in freed) * cfg.cluster.tp
    assert s["freed_gpu_s"] == pytest.approx(expect)
    tl = res.timeline_frame()
    for i in freed:  # no engine step after it was freed, nothing arrived
        assert (tl[tl.instance == i].time_s < st.freed_at[i]).all()
        assert not any(m[2] == i and m[0] >= st.freed_at[i] for m in st.migration_log)
    rebal = simulate(cfg, "static:3", "rebalance").summary()
    assert rebal["freed_gpu_s"] == 0  # rebalance keeps every instance in play


def test_freed_gpu_seconds_count_tensor_parallel_gpus():
    cfg = load_config("uneven-load", overrides=SMALL)
    one = simulate(cfg, "static:3", "none")
    st = one.records[0].stage
    assert one.summary()["freed_gpu_s"] == pytest.approx(float(np.nansum(st.makespan - st.freed_at)))
    two = simulate(cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"tp": 2})}), "static:3", "none")
    st2 = two.records[0].stage
    assert two.summary()["freed_gpu_s"] == pytest.approx(2 * float(np.nansum(st2.makespan - st2.freed_at)))


def test_none_moves_nothing_and_one_instance_never_reallocates():
    res = simulate(load_config("uneven-load", overrides=SMALL), "static:3", "none")
    assert res.summary()["migrations"] == 0 and not res.records[0].stage.realloc_active
    one = simulate(load_config("uneven-load", overrides=SMALL + ["cluster.instances=1"]), "static:3", "rebalance")
    assert one.summary()["migrations"] == 0 and one.summary()["freed_gpu_s"] == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rebalance_cuts_the_generation_stage_on_uneven_loads(seed):
    cfg = load_config("uneven-load", overrides=[f"seed={seed}"])
    none = simulate(cfg, "static:3", "none").summary()["generation_s"]
    rebal = simulate(cfg, "static:3", "rebalance").summary()
    assert rebal["migrations"] > 0
    assert rebal["generation_s"] <= 0.85 * none, (none, rebal["generation_s"])


# ---------------------------------------------------------------------- policies on their own
def view(i, n_running=0, n_waiting=0, ctx=1000, max_batch=64, kv_free=10**6, first_id=None):
    base = 1000 * i if first_id is None else first_id
    running = np.arange(base, base + n_running, dtype=np.int64)
    ctxs = np.full(n_running, ctx, dtype=np.int64) if np.isscalar(ctx) else np.asarray(ctx, dtype=np.int64)
    waiting = list(range(base + n_running, base + n_running + n_waiting))
    return InstanceView(i, running, ctxs, None, waiting, kv_free, max_batch)


def event(kind, instance, views):
    return ReallocEvent(kind, instance, 1.0, views)


def ids_of(migs: list[Migration]) -> list[int]:
    return [s for m in migs for s in m.sample_ids]


@pytest.mark.parametrize("policy", [Rebalance(), Consolidate()])
def test_idle_instance_takes_queued_work_from_the_longest_queues(policy, cost):
    views = [view(0), view(1, 64, 40), view(2, 64, 10), view(3, 30, 0)]
    migs = policy.on_event(event("idle", 0, views), cost)
    assert [(m.src, m.dst) for m in migs] == [(1, 0), (2, 0)]
    assert [len(m.sample_ids) for m in migs] == [40, 10]  # each donor keeps a full batch
    assert set(ids_of(migs)) <= set(views[1].waiting_ids) | set(views[2].waiting_ids)
    assert migs[0].sample_ids[0] == views[1].waiting_ids[-1]  # the back of the queue first


@pytest.mark.parametrize("policy", [Rebalance(), Consolidate()])
def test_never_more_than_the_destination_holds(policy, cost):
    views = [view(0, 60), view(1, 64, 200)]
    migs = policy.on_event(event("finished", 0, views), cost)
    assert len(ids_of(migs)) == 4  # 4 free slots
    views = [view(0, 10, kv_free=5000), view(1, 64, 200, ctx=1000)]
    assert len(ids_of(policy.on_event(event("drained", 0, views), cost))) == 5  # KV for 5
    views = [view(0, 64), view(1, 64, 200)]
    assert policy.on_event(event("finished", 0, views), cost) == []  # a full batch takes nothing


def test_rebalance_evens_out_the_tail_from_the_busiest_instance(cost):
    ctx = np.arange(30) * 100 + 500
    views = [view(0, 2), view(1, 30, ctx=ctx), view(2, 10)]
    migs = Rebalance().on_event(event("drained", 0, views), cost)
    assert len(migs) == 1 and (migs[0].src, migs[0].dst) == (1, 0)
    assert len(migs[0].sample_ids) == 14  # half the gap of 28: 16 and 16 afterwards
    assert set(migs[0].sample_ids) == set(views[1].running_ids[:14].tolist())  # the fewest tokens so far
    assert Rebalance().on_event(event("finished", 0, views), cost) == []  # not drained: leave the tail
    views = [view(0, 8), view(1, 10), view(2, 9)]
    assert Rebalance().on_event(event("drained", 0, views), cost) == []  # gap below min_gap: hysteresis
    full = [view(0, 2, max_batch=8), view(1, 30)]
    assert len(ids_of(Rebalance().on_event(event("idle", 0, full), cost))) == 6  # up to its max batch


def test_consolidate_hands_a_drained_tail_to_busier_instances(cost):
    views = [view(0, 5), view(1, 20), view(2, 12), view(3, 3)]
    migs = Consolidate().on_event(event("drained", 0, views), cost)
    assert sorted(ids_of(migs)) == views[0].running_ids.tolist()  # all of it
    assert {m.dst for m in migs} <= {1, 2} and all(m.src == 0 for m in migs)
    assert Consolidate().on_event(event("drained", 1, views), cost) == []  # the busiest keeps its work
    assert Consolidate().on_event(event("finished", 0, views), cost) == []  # only once drained
    # receivers too busy (their step far slower than the drained one's): a partial move frees nothing
    full = [view(0, 5), view(1, 62, ctx=4000)]
    assert Consolidate(slack=0.15).on_event(event("drained", 0, full), cost) == []
    assert Consolidate(slack=10.0).on_event(event("drained", 0, full), cost) == []  # only 2 slots: no
    roomy = [view(0, 5), view(1, 40, ctx=4000)]
    assert len(ids_of(Consolidate(slack=10.0).on_event(event("drained", 0, roomy), cost))) == 5


def test_none_and_unknown_names(cost):
    views = [view(0), view(1, 64, 100)]
    assert NoRealloc().on_event(event("idle", 0, views), cost) == []
    assert make_realloc_policy(" rebalance ").name == "rebalance"
    assert make_realloc_policy("consolidate").name == "consolidate"
    with pytest.raises(UserError, match="bogus"):
        make_realloc_policy("bogus")
    with pytest.raises(UserError, match="consolidate"):
        simulate(load_config("uneven-load", overrides=SMALL), "static:3", "rebalancee")
