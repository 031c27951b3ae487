"""The discrete-event simulator (SimPy) of the generation stage and the RL step. Never imports torch."""
