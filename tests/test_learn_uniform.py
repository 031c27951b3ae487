"""`rlsched learn`'s table search keeps the uniform tables (the static settings) as candidates:
the learned table is at least as fast as each of them on the learning seeds, and a refined
table replaces the best of them only when it wins by ACCEPT_MARGIN on every learning and
validation seed."""

from __future__ import annotations

import pytest

from rlsched.config import load_config
from rlsched.policies.lookup import TablePolicy
from rlsched.policies.policyfile import load_policy_file, save_policy_file
from rlsched.sim.learn import ACCEPT_EDGES, ACCEPT_MARGIN, Learner, ctx_edges
from rlsched.sim.simulate import config_identity, simulate

K_MAX = 3


@pytest.fixture(scope="module")
def cfg():
    small = ["workload.prompts=2", "workload.samples_per_prompt=4", "workload.response_len.median=200"]
    return load_config(
        "default", overrides=[*small, "workload.response_len.max=800", "rl.steps=1", f"speculation.k_max={K_MAX}"]
    )


def _cells(params: dict) -> list:
    return [c for plane in params["k"] for row in plane for c in row]


def _uniform_cell(params: dict):
    """The one cell of a uniform table; None for a table with several."""
    cells = _cells(params)
    return cells[0] if all(c == cells[0] for c in cells) else None


def _fake(cfg, price, seen=None):
    """An evaluator pricing each run by `price(table params, seed)`; `seen` collects (params, seed)."""

    def evaluate(jobs):
        out = []
        for c, spec, _ in jobs:
            params = load_policy_file(spec.split(":", 1)[1], config_identity(cfg)).params
            if seen is not None:
                seen.append((params, c.seed))
            out.append(price(params, c.seed))
        return out

    return evaluate


def test_the_learned_table_is_at_least_every_uniform_table_on_the_learning_seed(cfg, tmp_path):
    learner = Learner(cfg, [0], log=lambda *_: None)
    pf, t = learner.learn("table")
    seed0 = cfg.model_copy(update={"seed": 0})
    statics = [simulate(seed0, f"static:{k}" if k else "off").summary()["generation_s"] for k in range(K_MAX + 1)]
    assert t <= min(statics) * (1 + 1e-12)  # (a uniform table is its static setting, to rounding)
    path = tmp_path / "p.json"
    save_policy_file(path, pf)
    assert simulate(seed0, f"table:{path}").summary()["generation_s"] == pytest.approx(t, rel=1e-9)
    # the validation seeds are others than the learning seed, and the file records them
    assert pf.created["seeds"] == [0] and pf.created["validation_seeds"] and 0 not in pf.created["validation_seeds"]


def test_every_uniform_table_is_a_candidate(cfg):
    seen: list = []
    Learner(cfg, [0], _fake(cfg, lambda p, s: 1.0, seen), log=lambda *_: None).learn_table()
    uniform = {_uniform_cell(p) for p, _ in seen} - {None}
    assert uniform == set(range(K_MAX + 1))  # off and every k up to k_max


def test_a_uniform_table_comes_back_when_no_cell_change_wins(cfg):
    """Every table prices the same: the search has nothing to gain, and a uniform table stands."""
    params, t = Learner(cfg, [0], _fake(cfg, lambda p, s: 50.0), log=lambda *_: None).learn_table()
    assert _uniform_cell(params) is not None and t == 50.0


def _by_distance(best_k: int, refined_gain: float, lose_on: int | None = None):
    """Uniform tables priced by their distance from `best_k`; a table with several cells gains
    `refined_gain` over the best uniform one, except on seed `lose_on`, where it loses."""

    def price(params, seed):
        cell = _uniform_cell(params)
        if cell is not None:
            return 100.0 + abs(cell - best_k)
        return 100.0 * (1 + refined_gain) if seed == lose_on else 100.0 / (1 + refined_gain)

    return price


@pytest.mark.parametrize(
    "gain, lose_on, kept",
    [
        (ACCEPT_MARGIN / 2, None, False),  # wins on every seed, but by less than the margin
        (ACCEPT_MARGIN * 3, 101, False),  # wins on the learning seed, loses on a validation seed
        (ACCEPT_MARGIN * 3, None, True),  # wins by the margin everywhere
    ],
)
def test_a_refined_table_replaces_the_best_uniform_only_if_it_wins_on_every_seed(cfg, gain, lose_on, kept):
    seen: list = []
    learner = Learner(cfg, [0], _fake(cfg, _by_distance(2, gain, lose_on), seen), log=lambda *_: None)
    assert learner.validation_seeds == [100, 101]
    params, t = learner.learn_table()
    if kept:
        assert _uniform_cell(params) is None and t == pytest.approx(100.0 / (1 + gain))
    else:
        assert _uniform_cell(params) == 2 and t == 100.0
    assert {s for _, s in seen} == {0, 100, 101}  # validation seeds price only the final choice
    assert sum(s != 0 for _, s in seen) == 4


def test_the_refinement_starts_from_the_analytic_table_when_it_is_faster(cfg):
    """The analytic table is scored beside the uniform ones; when it is the fastest start and no
    change gains, it is the refined table, and it wins by the margin on every seed."""
    learner = Learner(cfg, [0], log=lambda *_: None)
    ctx = learner.ctx
    analytic = TablePolicy.analytic(ctx, learner.drafter, ACCEPT_EDGES, ctx_edges(ctx.typical_ctx)).params()["k"]
    fake = _fake(cfg, lambda p, s: 90.0 if p["k"] == analytic else 100.0)
    params, t = Learner(cfg, [0], fake, log=lambda *_: None).learn_table()
    assert params["k"] == analytic and t == 90.0
