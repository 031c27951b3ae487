"""vLLM as a rollout backend: the CPU build's shims, what an engine is started with (`spec`), the
engine wrapper, the scheduler hook that asks rlsched's DraftPolicy each step, and the step costs
measured through it at start-up (`calibrate`)."""
