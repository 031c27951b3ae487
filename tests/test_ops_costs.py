"""The per-op layer cost model (`rlsched/costs/ops.py`) against its closed forms, and its
calibration recovering known efficiencies and floors from data it generated."""

import numpy as np
import pytest

from rlsched.costs.ops import OpCosts, Shape, allreduce_time, attention_time, elementwise_time, fit_allreduce, \
    fit_op_costs, layer_time, linear_times

H100 = OpCosts(989.0, 3350.0)
LLAMA_8B = Shape(4096, 32, 8, 128, 14336)


def test_a_linear_reads_its_weights_at_one_token_and_computes_at_many():
    c, s = H100, LLAMA_8B
    p = s.linear_params(1)["up"]  # 4096 x 2 x 14336
    one = linear_times(c, s, 1)["up"]
    io = s.linear_io(1)["up"]
    assert one == pytest.approx((p + io) * 2 / (3350e9 * c.memory_eff) + c.linear_floor_us * 1e-6, rel=1e-12)
    many = linear_times(c, s, 8192)["up"]
    assert many == pytest.approx(2 * 8192 * p / (989e12 * c.compute_eff) + c.linear_floor_us * 1e-6, rel=1e-12)
    # the turn: below it the time barely grows with tokens, above it grows linearly
    t = np.array([1, 2, 4, 8])
    assert np.ptp(linear_times(c, s, t)["up"]) / one < 0.01


def test_sharding_divides_the_weights_and_the_all_reduce_appears():
    s = LLAMA_8B
    assert s.linear_params(4)["qkv"] == pytest.approx(s.linear_params(1)["qkv"] / 4)
    assert float(allreduce_time(H100, 1 << 20, 1)) == 0.0
    ar = float(allreduce_time(H100, 1 << 20, 4))
    assert ar == pytest.approx(H100.allreduce_latency_us * 1e-6 + (1 << 20) * 1.5 / (H100.allreduce_bus_gbs * 1e9))
    one = float(layer_time(H100, s, 1, tp=1))
    four = float(layer_time(H100, s, 1, tp=4))
    assert four == pytest.approx(float(sum(linear_times(H100, s, 1, 4).values()) + elementwise_time(H100, s, 1, 4))
                                 + 2 * float(allreduce_time(H100, 4096 * 2, 4)))
    assert four < one


def test_decode_attention_reads_the_kv_cache():
    s, c = LLAMA_8B, H100
    ctx = 64 * 4096
    t = float(attention_time(c, s, 1, ctx))
    assert t == pytest.approx(ctx * 2 * 8 * 128 * 2 / (3350e9 * c.attention_eff) + c.attention_floor_us * 1e-6)
    assert float(layer_time(c, s, 64, ctx_tokens=ctx)) == pytest.approx(float(layer_time(c, s, 64)) + t)


def test_calibration_recovers_the_parameters_that_made_the_data():
    truth = OpCosts(989.0, 3350.0, compute_eff=0.72, memory_eff=0.81, linear_floor_us=7.0, elementwise_eff=0.3,
                    elementwise_floor_us=4.0)
    rows = []
    tokens = np.unique(np.geomspace(1, 4096, 40).astype(int)).astype(float)
    for s in (LLAMA_8B, Shape(8192, 64, 8, 128, 28672)):
        for tp in (1, 2, 8):
            rows.append((s, tp, tokens, linear_times(truth, s, tokens, tp), elementwise_time(truth, s, tokens, tp),
                         truth.elementwise_kernels))
    got = fit_op_costs(OpCosts(989.0, 3350.0), rows)
    for name in ("compute_eff", "memory_eff", "linear_floor_us", "elementwise_eff", "elementwise_floor_us"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-3), name
    sizes = np.geomspace(2048, 64 << 20, 30)
    tps = np.repeat([2, 4, 8], len(sizes))
    nbytes = np.tile(sizes, 3)
    meas = np.concatenate([allreduce_time(truth, sizes, tp) for tp in (2, 4, 8)])
    ar = fit_allreduce(OpCosts(989.0, 3350.0), tps, nbytes, meas)
    assert ar.allreduce_latency_us == pytest.approx(truth.allreduce_latency_us, rel=1e-3)
    assert ar.allreduce_bus_gbs == pytest.approx(truth.allreduce_bus_gbs, rel=1e-3)
