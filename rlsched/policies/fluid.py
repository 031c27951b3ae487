"""The fluid drain: what the rest of one instance's rollout costs under a strategy, in expectation.

Each row still needs `rem_i` tokens and gains E_i(s) tokens a step under strategy s (one plus
its expected accepted drafts), so it finishes after rem_i / E_i(s) steps. Queued rows take the
slots that free, in order (list scheduling). The batch at step t is the rows started and not
finished, and a step of b rows costs t_s(b): the strategy's draft and verify at b rows of the
drain's context, interpolated on a grid of batch sizes. The drain's time is the integral of
t_s(b(t)) over its steps.

What the model leaves out: the spread of each row's accepted drafts about their mean (a row's
finish is a sum of hundreds of steps' draws, so it sits near its mean), contexts growing
within the drain (every step is priced at one context a row), and prefills (the same under
every strategy).
"""

from __future__ import annotations

import heapq

import numpy as np


def grid_of_batches(max_batch: int) -> np.ndarray:
    """Every batch size up to 16, then steps of about 1/8 up to `max_batch`."""
    sizes = set(range(1, min(16, max_batch) + 1))
    b = 16.0
    while b < max_batch:
        b *= 1.125
        sizes.add(min(int(round(b)), max_batch))
    return np.array(sorted(sizes), dtype=float)


def schedule(steps_running: np.ndarray, steps_queued: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, finish) step of every row, running rows first: the running rows start at 0; each
    queued row, in order, starts when the first slot frees (`slots` rows run at once)."""
    n_run = len(steps_running)
    if len(steps_queued) == 0:
        return np.zeros(n_run), steps_running
    free = steps_running.tolist() + [0.0] * max(0, slots - n_run)
    heapq.heapify(free)
    starts = np.empty(len(steps_queued))
    for j, n in enumerate(steps_queued.tolist()):
        t = free[0]
        starts[j] = t
        heapq.heapreplace(free, t + n)
    return np.concatenate((np.zeros(n_run), starts)), np.concatenate((steps_running, starts + steps_queued))


def drain_seconds(start: np.ndarray, finish: np.ndarray, grid: np.ndarray, prices: np.ndarray, until=np.inf) -> float:
    """Seconds of the steps from 0 to `until` (all, by default): a step while b rows are between
    their start and finish costs `prices` interpolated at b on `grid`."""
    if len(finish) == 0:
        return 0.0
    if not start.any():  # no queue: the batch only shrinks
        t = np.concatenate(([0.0], np.sort(finish)))
        b = (len(finish) - np.arange(len(finish))).astype(float)
    else:
        times = np.concatenate((start, finish))
        order = np.argsort(times, kind="stable")
        t = times[order]
        b = np.cumsum(np.concatenate((np.ones(len(start)), -np.ones(len(finish))))[order])[:-1]
    t = np.minimum(t, until)
    return float(np.diff(t) @ np.interp(b, grid, prices))
