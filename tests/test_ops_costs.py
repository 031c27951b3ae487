"""The per-op layer cost model (`rlsched/costs/ops.py`) against its closed forms, and its
calibration recovering known efficiencies and floors from data it generated."""

import numpy as np
import pytest

from rlsched.costs.ops import (
    OpCosts,
    Shape,
    allreduce_time,
    attention_time,
    elementwise_time,
    fit_allreduce,
    fit_op_costs,
    layer_time,
    linear_times,
)

H100 = OpCosts(989.0, 3350.0)
LLAMA_8B = Shape(4096, 32, 8, 128, 14336)


def test_a_linear_reads_its_weights_at_one_token_and_computes_at_many():
    c, s = H100, LLAMA_8B
    p = s.linear_params(1)["up"]  # 4096 x 2 x 14336
    io = s.linear_io(1)["up"]

    def closed(t):  # whole tiles of tokens computed, weights and activations read, a smooth max
        compute = 2 * np.ceil(t / c.linear_tile) * c.linear_tile * p / (989e12 * c.compute_eff)
        memory = (p + t * io) * 2 / (3350e9 * c.memory_eff)
        k = c.linear_knee
        return (compute**k + memory**k) ** (1 / k) + c.linear_floor_us * 1e-6

    one = linear_times(c, s, 1)["up"]
    assert one == pytest.approx(closed(1), rel=1e-12)
    assert one > (p + io) * 2 / (3350e9 * c.memory_eff) + c.linear_floor_us * 1e-6  # the tile's math shows
    many = linear_times(c, s, 8192)["up"]
    assert many == pytest.approx(closed(8192), rel=1e-12)
    assert many == pytest.approx(2 * 8192 * p / (989e12 * c.compute_eff), rel=0.05)  # compute-bound
    # the turn: below it the time barely grows with tokens, above it grows linearly
    t = np.array([1, 2, 4, 8])
    assert np.ptp(linear_times(c, s, t)["up"]) / one < 0.01


def test_a_tile_computes_all_its_rows_and_a_sharp_knee_is_the_plain_max():
    s, p = LLAMA_8B, LLAMA_8B.linear_params(1)["down"]
    c = OpCosts(989.0, 3350.0, linear_tile=1024)
    # compute-bound: 1025 tokens cost two tiles, as much as 2048
    t = linear_times(c, s, [1024, 1025, 2048, 2049], 1)["down"] - c.linear_floor_us * 1e-6
    io = s.linear_io(1)["down"]
    assert t[1] > 1.5 * t[0] and t[1] == pytest.approx(t[2], rel=0.02) and t[3] > 1.4 * t[2]
    sharp = OpCosts(989.0, 3350.0, linear_tile=1, linear_knee=200.0)
    tokens = np.array([1.0, 64.0, 4096.0])
    plain = (
        np.maximum(2 * tokens * p / (989e12 * sharp.compute_eff), (p + tokens * io) * 2 / (3350e9 * sharp.memory_eff))
        + sharp.linear_floor_us * 1e-6
    )
    assert linear_times(sharp, s, tokens, 1)["down"] == pytest.approx(plain, rel=0.01)


def test_element_wise_kernels_are_row_bound_at_few_tokens_and_bandwidth_bound_at_many():
    c, s = H100, LLAMA_8B
    row = s.elementwise_elements(1) * 2
    floors = c.elementwise_kernels * c.elementwise_floor_us * 1e-6
    few = elementwise_time(c, s, [1, 8], 1)
    assert few == pytest.approx(floors + row / (c.elementwise_row_gbs * 1e9))  # flat: one row per block
    many = float(elementwise_time(c, s, 8192, 1))
    assert many == pytest.approx(floors + 8192 * row / (3350e9 * c.elementwise_eff))
    # a wider row (TP 1 against TP 8) takes longer at one token
    assert float(elementwise_time(c, s, 1, 1)) > float(elementwise_time(c, s, 1, 8))


def test_sharding_divides_the_weights_and_the_all_reduce_appears():
    s = LLAMA_8B
    assert s.linear_params(4)["qkv"] == pytest.approx(s.linear_params(1)["qkv"] / 4)
    assert float(allreduce_time(H100, 1 << 20, 1)) == 0.0
    ar = float(allreduce_time(H100, 1 << 20, 4))
    assert ar == pytest.approx(H100.allreduce_latency_us * 1e-6 + (1 << 20) * 1.5 / (H100.allreduce_bus_gbs * 1e9))
    one = float(layer_time(H100, s, 1, tp=1))
    four = float(layer_time(H100, s, 1, tp=4))
    assert four == pytest.approx(
        float(sum(linear_times(H100, s, 1, 4).values()) + elementwise_time(H100, s, 1, 4))
        + 2 * float(allreduce_time(H100, 4096 * 2, 4))
    )
    assert four < one


def test_decode_attention_reads_the_kv_cache():
    s, c = LLAMA_8B, H100
    ctx = 64 * 4096
    t = float(attention_time(c, s, 1, ctx))
    assert t == pytest.approx(ctx * 2 * 8 * 128 * 2 / (3350e9 * c.attention_eff) + c.attention_floor_us * 1e-6)
    assert float(layer_time(c, s, 64, ctx_tokens=ctx)) == pytest.approx(float(layer_time(c, s, 64)) + t)


def test_calibration_recovers_the_parameters_that_made_the_data():
    truth = OpCosts(
        989.0,
        3350.0,
        compute_eff=0.72,
        memory_eff=0.81,
        linear_floor_us=7.0,
        elementwise_eff=0.3,
        elementwise_floor_us=4.0,
        elementwise_row_gbs=12.0,
        linear_knee=2.5,
    )
    rows = []
    tokens = np.unique(np.geomspace(1, 4096, 40).astype(int)).astype(float)
    for s in (LLAMA_8B, Shape(8192, 64, 8, 128, 28672)):
        for tp in (1, 2, 8):
            rows.append(
                (
                    s,
                    tp,
                    tokens,
                    linear_times(truth, s, tokens, tp),
                    elementwise_time(truth, s, tokens, tp),
                    truth.elementwise_kernels,
                )
            )
    got = fit_op_costs(OpCosts(989.0, 3350.0), rows)
    for name in (
        "compute_eff",
        "memory_eff",
        "linear_floor_us",
        "elementwise_eff",
        "elementwise_floor_us",
        "elementwise_row_gbs",
        "linear_knee",
    ):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-3), name
    sizes = np.geomspace(2048, 64 << 20, 30)
    tps = np.repeat([2, 4, 8], len(sizes))
    nbytes = np.tile(sizes, 3)
    meas = np.concatenate([allreduce_time(truth, sizes, tp) for tp in (2, 4, 8)])
    ar = fit_allreduce(OpCosts(989.0, 3350.0), tps, nbytes, meas)
    assert ar.allreduce_latency_us == pytest.approx(truth.allreduce_latency_us, rel=1e-3)
    assert ar.allreduce_bus_gbs == pytest.approx(truth.allreduce_bus_gbs, rel=1e-3)
