"""The real executor: the only part of rlsched that imports torch (install `rlsched[executor]`).

- model/: the Llama-family transformer, KV cache, rope, loading and saving, the built-in pair
- decode/: sampling, the speculative step, tree verification, the drafters
- engine/: rlsched's rollout engine
- pool/: several engines as Ray actors, with sample reallocation
- vllm/: vLLM as a rollout backend, and the scheduler hook that runs rlsched's policies in it
- rl/: the RL trainer (GRPO/PPO), rewards, data, checkpoints, drafter distillation
- backends.py (the rollout backend), setup.py (what generate and run set up alike),
  generate.py, profiler.py and profile_run.py (the profile command), and the prompts,
  folders, seeds and gc helpers

Import the submodules explicitly; this package itself imports nothing, so that importing
`rlsched` never pulls torch in.
"""
