"""vLLM as a rollout backend: the CPU build's shims, the engine wrapper, and the scheduler hook
that asks rlsched's DraftPolicy each step."""
