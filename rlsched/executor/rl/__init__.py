"""RL training on the rollout engine."""
