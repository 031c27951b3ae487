"""Policies: drafting-strategy selection and sample reallocation. Never imports sim/ or torch."""

from rlsched.policies.acceptance import AcceptanceEstimator
from rlsched.policies.draft import PolicyContext, expected_tokens
from rlsched.policies.realloc import make_realloc_policy
from rlsched.policies.registry import make_draft_policy, parse_policy
from rlsched.policies.types import (
    OFF,
    CostModel,
    DraftPolicy,
    EngineState,
    InstanceView,
    Migration,
    ReallocEvent,
    ReallocPolicy,
    StepOutcome,
    Strategy,
)

__all__ = [
    "AcceptanceEstimator",
    "PolicyContext",
    "expected_tokens",
    "make_draft_policy",
    "make_realloc_policy",
    "OFF",
    "CostModel",
    "DraftPolicy",
    "EngineState",
    "InstanceView",
    "Migration",
    "ReallocEvent",
    "ReallocPolicy",
    "StepOutcome",
    "Strategy",
    "parse_policy",
]
