"""rlsched's rollout engine (`rollout`): continuous batching around the speculative step, with its
rows (`rows`), admissions (`admission`), row migration between engines (`migration`) and the
step and sample recorder that vLLM's hook shares (`recorder`)."""
