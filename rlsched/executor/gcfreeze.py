"""Keep Python's full garbage collections off the timed steps of a run.

A full (generation 2) collection walks every tracked object: with torch, transformers, pandas
and a run's models loaded that is hundreds of thousands of objects and a pause of a large part
of a step, landing on whichever RL step or engine step crossed the threshold (a spike in that
step's time, noise for the replay's per-step comparison). Frozen objects (those alive once a
run is set up: modules, models, configs) are never walked again, which shortens the pause
several-fold; the garbage a run makes is collected as before.
"""

from __future__ import annotations

import gc


def freeze_long_lived() -> None:
    """Collect once, then move every object alive now out of the collector's view."""
    gc.collect()
    gc.freeze()
