"""RL training on the rollout backends: the run config and what it builds, the trainer (GRPO and
PPO steps, the drafter's update schedule), rewards and data, checkpoints and resume, the run's
records, and distilling the drafter from the target."""
