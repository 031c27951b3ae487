"""The rollout backends (rlsched's engine, the Ray pool, vLLM) implement one interface,
`executor/backends.py`'s RolloutBackend: the same methods with the same signatures (checked
on the classes, so neither Ray nor vLLM starts)."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("torch")

from support import tiny_pair  # noqa: E402

from rlsched.executor.backends import RolloutBackend  # noqa: E402
from rlsched.executor.decode.drafters import NgramDrafter  # noqa: E402
from rlsched.executor.decode.sampling import GREEDY  # noqa: E402
from rlsched.executor.engine.rollout import RolloutEngine  # noqa: E402
from rlsched.executor.engine.rows import Request  # noqa: E402
from rlsched.executor.pool.instances import InstancePool  # noqa: E402
from rlsched.executor.vllm.engine import VllmRolloutEngine  # noqa: E402

METHODS = [name for name, v in vars(RolloutBackend).items() if inspect.isfunction(v) and not name.startswith("_")]


def _parameters(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("cls", [RolloutEngine, InstancePool, VllmRolloutEngine], ids=lambda c: c.__name__)
def test_every_backend_has_the_interfaces_methods_and_signatures(cls):
    assert METHODS == ["run", "resize", "sync_weights", "policy_state", "close"]
    for name in METHODS:
        assert _parameters(getattr(cls, name)) == _parameters(getattr(RolloutBackend, name)), f"{cls.__name__}.{name}"
        assert getattr(cls, name).__doc__, f"{cls.__name__}.{name} says what it does"


def test_the_local_engine_is_a_backend_and_its_policy_state_holds_the_ngram_history(tmp_path):
    target, _ = tiny_pair(tmp_path / "tiny", 16)
    engine = RolloutEngine(target, NgramDrafter(max_n=3), 1000, 4, GREEDY, "static:2")
    assert isinstance(engine, RolloutBackend)
    engine.run([Request([1, 2, 3], 7, 0, 8, None)])
    policy, estimator, history = engine.policy_state()
    assert policy is engine.policy and estimator is engine.estimator and history and 7 in history
    engine.close()
