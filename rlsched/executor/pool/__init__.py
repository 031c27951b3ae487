"""Several rollout instances as Ray actors: the worker, sample moves between instances, and
the pool that drives them with a reallocation policy."""
