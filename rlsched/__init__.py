"""rlsched: adaptive speculative decoding and sample reallocation for RL rollouts."""

__version__ = "0.1.0"
