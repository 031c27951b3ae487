"""rlsched's draft policies inside vLLM, by engine arguments: `--scheduler-cls
rlsched.vllm.PolicyScheduler` and `--additional-config '{"rlsched": {...}}'`
(`executor/vllm/scheduler.py` says what the block holds). Importing this module imports vLLM."""

from rlsched.executor.vllm.scheduler import EngineHookConfig, PolicyScheduler

__all__ = ["EngineHookConfig", "PolicyScheduler"]
