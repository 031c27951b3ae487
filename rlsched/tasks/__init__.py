"""Built-in tasks with verifiable rewards (numpy only: no torch here)."""
