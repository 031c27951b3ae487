"""Planning a rollout setup: analytic estimates that screen many setups before the simulator
ranks the survivors."""
