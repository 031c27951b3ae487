"""rlsched's rollout engine: continuous batching around the speculative step, asking a
DraftPolicy every step and writing a step record for each."""
