"""`rlsched learn`: find table / two-state parameters and reallocation thresholds in the simulator.

Every candidate is priced by simulating it on the learning seeds, as `compare` prices a policy
(the generation stage of the config's RL steps). A table's search starts from the uniform tables
(every static setting) and the cost model's analytic table and refines the better start by
coordinate descent over its cells; a refined table replaces the best uniform one only when it
also wins on held-out validation seeds. The two-state search is a grid over its threshold and k;
then a sweep of the reallocation threshold. Candidates are written as policy files and simulated
by name, so they run in worker processes too.
"""

from __future__ import annotations

import tempfile
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from rlsched import __version__
from rlsched.config import SimConfig, length_max
from rlsched.costs.choose import cost_model_for
from rlsched.policies.engine_args import EAGLE_PLACEHOLDER, EngineFacts, HookSettings, framework_files
from rlsched.policies.lookup import TablePolicy, TwoStatePolicy, batch_grid
from rlsched.policies.policyfile import (
    FORMAT,
    SHAPE_KEYS,
    VERSION,
    PolicyFile,
    PolicyKind,
    ReallocSettings,
    save_policy_file,
)
from rlsched.policies.tree import max_nodes
from rlsched.sim.simulate import config_identity, policy_context
from rlsched.sim.sizes import check_fits

ACCEPT_EDGES = [0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
# context-bucket edges, in units of the workload's typical context per sequence: half-octave steps
# rather than whole octaves (0.5/1/2/4), because within one octave of context the verify's price
# moves enough to change the best k; half octaves bring the analytic table close to the per-step
# oracle on unseen seeds
CTX_FACTORS = tuple(2 ** (i / 2) for i in range(-2, 5))
REALLOC_THRESHOLDS = [4, 8, 16, 32, 64]
# A table cell's change is kept only if it cuts the learning seeds' stage time by this much: one
# cell moves which rows finish when, and so the whole rollout's order, by chance. Smaller gains on
# the learning seed do not carry over to other seeds (they move either way there), and a table
# learned with every gain kept does worse on unseen seeds than its analytic start.
MIN_GAIN = 0.0025
# A refined table replaces the best uniform table (the best static setting) only if it is faster
# by this much on every learning seed and on every validation seed: seeds move a non-uniform
# table against a static setting by about a percent either way.
ACCEPT_MARGIN = 0.01
VALIDATION_OFFSET = 100  # validation seeds: the last learning seed + 100, + 101, ...
VALIDATION_SEEDS = 2
MAX_UNIFORM_TREES = 4  # uniform tree tables tried: the analytic table's most used trees


def ctx_edges(typical_ctx: int) -> list[int]:
    """Context-per-sequence bucket edges around the workload's typical context: a fixed grid
    (512, 1024, ...) would put every context of a small workload in one bucket priced far from it."""
    return sorted({0, *(max(1, round(typical_ctx * f)) for f in CTX_FACTORS)})


# evaluate(list of (cfg, policy name, realloc name)) -> generation seconds of each run
Evaluator = Callable[[list[tuple[SimConfig, str, str]]], list[float]]


def serial_evaluator(jobs):
    from rlsched.sim.simulate import simulate

    return [simulate(cfg, pol, realloc).summary()["generation_s"] for cfg, pol, realloc in jobs]


def parallel_evaluator(workers: int, ray_address: str | None = None) -> Evaluator:
    """Score runs on worker processes (or Ray) with the simulations' runner (`sim/runs.py`), grouped by config."""
    from rlsched.sim.runs import run_jobs

    def evaluate(jobs):
        times = [0.0] * len(jobs)
        groups: dict = {}
        for i, (cfg, pol, realloc) in enumerate(jobs):
            base = cfg.model_copy(update={"seed": 0})
            groups.setdefault(base.model_dump_json(), (base, []))[1].append((i, pol, realloc, cfg.seed))
        for base, items in groups.values():
            results = run_jobs(
                base, [(pol, realloc, seed, None) for _, pol, realloc, seed in items], workers, ray_address
            )
            for (i, *_), r in zip(items, results):
                times[i] = r["summary"]["generation_s"]
        return times

    return evaluate


class Learner:
    def __init__(
        self,
        cfg: SimConfig,
        seeds: list[int],
        evaluate: Evaluator = serial_evaluator,
        log=print,
        validation_seeds: list[int] | None = None,
    ):
        """`seeds`: the learning seeds, which score every candidate; `validation_seeds` (default
        VALIDATION_SEEDS seeds from the last learning seed + VALIDATION_OFFSET) only decide whether
        a refined table replaces the best uniform one."""
        self.cfg, self.seeds, self.evaluate, self.log = cfg, seeds, evaluate, log
        if validation_seeds is None:
            validation_seeds = [max(seeds) + VALIDATION_OFFSET + i for i in range(VALIDATION_SEEDS)]
        self.validation_seeds = [s for s in validation_seeds if s not in seeds]
        # its table and two-state rule price every batch up to max_batch; its runs are checked where they run
        check_fits(cfg, grid=True)
        self.cost = cost_model_for(cfg)
        self.ctx = policy_context(cfg, self.cost)
        self.drafter = cfg.drafters[0].name
        self.realloc = cfg.cluster.realloc
        self.evaluations = 0
        # candidate policy files for the evaluator's workers; removed with the learner (or at exit)
        self._tmp = tempfile.TemporaryDirectory(prefix="rlsched-learn-")
        self._dir = Path(self._tmp.name)
        self._n = 0

    # ------------------------------------------------------------------ scoring
    def _policy_file(self, kind: PolicyKind, params: dict, realloc: ReallocSettings | None = None) -> PolicyFile:
        return PolicyFile(
            format=FORMAT,
            version=VERSION,
            kind=kind,
            drafter=self.drafter,
            params=params,
            realloc=realloc or ReallocSettings(policy=self.realloc, threshold=self.cfg.cluster.realloc_threshold),
            learned_on={
                **config_identity(self.cfg),
                "cost_model": self.cost.describe(),
                "model_shape": {k: getattr(self.cfg.model, k) for k in SHAPE_KEYS},
                "workload": self.cfg.workload.model_dump(mode="json"),
                "config_name": self.cfg.name,
            },
            created={
                "rlsched": __version__,
                "seeds": self.seeds,
                "validation_seeds": self.validation_seeds,
                "utc": datetime.now(UTC).isoformat(timespec="seconds"),
            },
        )

    def _spec(self, kind: PolicyKind, params: dict) -> str:
        self._n += 1
        path = self._dir / f"cand-{self._n}.json"
        save_policy_file(path, self._policy_file(kind, params))
        if kind == "table" or "width" in params:  # (a twostate tree has no spelling but its file)
            return f"{kind}:{path}"
        return f"twostate:{params['max_batch_on']}:{params['k']}"

    def score(self, specs: list[str], thresholds: list[int] | None = None) -> list[float]:
        """Mean generation time over the learning seeds of each candidate policy name."""
        return [float(t) for t in self._times(specs, self.seeds, thresholds).mean(axis=1)]

    def _times(self, specs: list[str], seeds: list[int], thresholds: list[int] | None = None) -> np.ndarray:
        """Generation time (the whole generation stage of the config's RL steps, as `compare`
        prices it) of each candidate policy name on each seed: (candidates, seeds)."""
        jobs, thresholds = [], thresholds or [self.cfg.cluster.realloc_threshold] * len(specs)
        for spec, thr in zip(specs, thresholds):
            for s in seeds:
                cfg = self.cfg.model_copy(
                    update={
                        "seed": s,
                        "record_timeline": False,
                        "cluster": self.cfg.cluster.model_copy(update={"realloc_threshold": thr}),
                    }
                )
                jobs.append((cfg, spec, self.realloc))
        times = self.evaluate(jobs) if jobs else []
        self.evaluations += len(jobs)
        return np.asarray(times, dtype=float).reshape(len(specs), len(seeds))

    # ------------------------------------------------------------------ searches
    def learn_twostate(self) -> tuple[dict, float]:
        start = TwoStatePolicy.solve(self.ctx, self.drafter)
        grid = [0] + batch_grid(self.cfg.cluster.max_batch)
        ks = range(1, min(self.cfg.speculation.k_max, 6) + 1)
        cands = [{"max_batch_on": t, "k": k} for t in grid for k in ks]
        if "width" in start.params():  # the solved tree, at every threshold
            cands += [{**start.params(), "max_batch_on": t} for t in grid]
        times = self.score([self._spec("twostate", c) for c in cands])
        i = int(np.argmin(times))
        self.log(f"twostate: analytic {start.params()} -> simulated best {cands[i]} ({times[i]:.2f} s)")
        return cands[i], times[i]

    def learn_table(self) -> tuple[dict, float]:
        """The best of the uniform tables (one strategy in every cell: each k the config allows,
        off included, and the analytic table's trees; these are the static settings) and the
        cost model's analytic table, refined by one coordinate pass (`_refine`). The refined
        table is kept only if it is not uniform and beats the best uniform table by ACCEPT_MARGIN
        on every learning seed and every validation seed (seeds the search never tuned on);
        otherwise the best uniform table stands. Returns its params and mean time on the
        learning seeds."""
        analytic = TablePolicy.analytic(self.ctx, self.drafter, ACCEPT_EDGES, ctx_edges(self.ctx.typical_ctx))
        uniform = [self._uniform(analytic, cell) for cell in self._uniform_cells(analytic)]
        times = self._times([self._spec("table", p) for p in [*uniform, analytic.params()]], self.seeds)
        means = times.mean(axis=1)
        self.log("table: uniform " + ", ".join(f"{_cell_name(p)} {t:.2f} s" for p, t in zip(uniform, means)))
        u = int(np.argmin(means[:-1]))
        self.log(f"table: analytic start {means[-1]:.2f} s; best uniform {_cell_name(uniform[u])} {means[u]:.2f} s")
        start = -1 if means[-1] < means[u] else u
        params, seed_times = self._refine(([*uniform, analytic.params()])[start], times[start])
        if _is_uniform(params):
            return params, float(seed_times.mean())
        held = self._times([self._spec("table", p) for p in (params, uniform[u])], self.validation_seeds)
        table_t = np.concatenate((seed_times, held[0]))
        uniform_t = np.concatenate((times[u], held[1]))
        gains = uniform_t / table_t - 1
        seeds = ", ".join(f"{s}: {g:+.2%}" for s, g in zip([*self.seeds, *self.validation_seeds], gains))
        if np.all(gains > ACCEPT_MARGIN):
            self.log(f"table: kept over uniform {_cell_name(uniform[u])} (gain by seed {seeds})")
            return params, float(seed_times.mean())
        self.log(f"table: uniform {_cell_name(uniform[u])} kept; the refined table gains {seeds}")
        return uniform[u], float(means[u])

    def _refine(self, params: dict, seed_times: np.ndarray) -> tuple[dict, np.ndarray]:
        """One coordinate pass (k - 1, k + 1) over the drafter's acceptance row and its two
        neighbours (a batch's mean acceptance strays there as the batch shrinks): per row, the
        cells the table's rollout spends time in, from the largest batch down (cells it never
        visits cannot change the score). A change stays if it cuts the mean time on the learning
        seeds by at least MIN_GAIN. Returns the table and its time on each learning seed."""
        best = float(seed_times.mean())
        prior = min(max(bisect_right(ACCEPT_EDGES, self.ctx.prior(self.drafter)) - 1, 0), len(ACCEPT_EDGES) - 2)
        rows = [r for r in (prior, prior - 1, prior + 1) if 0 <= r < len(ACCEPT_EDGES) - 1]  # and its neighbours
        for row in rows:
            for cc, col in self._visited_cells(params):  # under the table as refined so far
                k = params["k"][row][cc][col]
                trial = self._neighbours(k)
                cands = []
                for kk in trial:
                    p = {**params, "k": [[list(r) for r in plane] for plane in params["k"]]}
                    p["k"][row][cc][col] = kk
                    cands.append(p)
                if not cands:
                    continue
                times = self._times([self._spec("table", c) for c in cands], self.seeds)
                j = int(np.argmin(times.mean(axis=1)))
                if times[j].mean() < best * (1 - MIN_GAIN):
                    params, seed_times, best = cands[j], times[j], float(times[j].mean())
                    self.log(
                        f"table: acceptance >= {ACCEPT_EDGES[row]}, batch >= {params['batch_edges'][col]}, "
                        f"context >= {params['ctx_edges'][cc]}: k {k} -> {trial[j]} ({best:.2f} s)"
                    )
        return params, seed_times

    def _uniform_cells(self, analytic: TablePolicy) -> list:
        """The cells of the uniform tables: each k up to k_max (0: off) and, where the config
        drafts trees, the analytic table's trees in its drafter's acceptance row, most used first."""
        plane = analytic.k[analytic._row(self.ctx.prior(self.drafter))]
        trees = Counter(tuple(c) for row in plane for c in row if isinstance(c, list))
        return [*range(self.cfg.speculation.k_max + 1), *(list(t) for t, _ in trees.most_common(MAX_UNIFORM_TREES))]

    @staticmethod
    def _uniform(analytic: TablePolicy, cell) -> dict:
        """The table with `analytic`'s edges and `cell` in every cell."""
        p = analytic.params()
        return {**p, "k": [[[cell] * len(p["batch_edges"]) for _ in p["ctx_edges"]] for _ in ACCEPT_EDGES[:-1]]}

    def _neighbours(self, cell) -> list:
        """The cells a coordinate pass tries instead of `cell`: a chain one draft shorter and
        longer (0: off), a tree one level shallower and deeper with its width and nodes."""
        k_max = self.cfg.speculation.k_max
        if isinstance(cell, list):
            k, w, n = cell
            return [[kk, w, n] for kk in (k - 1, k + 1) if 1 <= kk <= min(k_max, n) and n <= max_nodes(kk, w)]
        return [kk for kk in (cell - 1, cell + 1) if 0 <= kk <= k_max]

    def _visited_cells(self, params: dict, min_share: float = 0.005) -> list[tuple[int, int]]:
        """(context bucket, batch bucket) cells holding at least `min_share` of the engine time
        of this table's rollout on the first learning seed; largest batch first."""
        from rlsched.sim.simulate import simulate

        cfg = self.cfg.model_copy(update={"seed": self.seeds[0], "record_timeline": True})
        t = simulate(cfg, self._spec("table", params), self.realloc).timeline_frame()
        t = t[(t["kind"] != "prefill") & (t["batch"] > 0)]
        ctx_col = np.searchsorted(params["ctx_edges"], t["ctx_tokens"] / t["batch"], side="right") - 1
        batch_col = np.searchsorted(params["batch_edges"], t["batch"], side="right") - 1
        share = t["step_ms"].groupby([ctx_col, batch_col]).sum() / max(t["step_ms"].sum(), 1e-12)
        return sorted((c for c, v in share.items() if v >= min_share), key=lambda c: (-c[1], c[0]))

    def learn_realloc(self, kind: PolicyKind, params: dict) -> ReallocSettings:
        if self.realloc == "none" or self.cfg.cluster.instances < 2:
            return ReallocSettings(policy=self.realloc, threshold=self.cfg.cluster.realloc_threshold)
        spec = self._spec(kind, params)
        times = self.score([spec] * len(REALLOC_THRESHOLDS), REALLOC_THRESHOLDS)
        thr = REALLOC_THRESHOLDS[int(np.argmin(times))]
        self.log(f"realloc {self.realloc}: threshold {thr} ({min(times):.2f} s)")
        return ReallocSettings(policy=self.realloc, threshold=thr)

    def learn(self, kind: PolicyKind = "table") -> tuple[PolicyFile, float]:
        params, t = self.learn_table() if kind == "table" else self.learn_twostate()
        realloc = self.learn_realloc(kind, params)
        return self._policy_file(kind, params, realloc), t


def _cell_name(params: dict) -> str:
    """The static setting a uniform table is (from its first cell): off, static:K or tree:K:W:N."""
    cell = params["k"][0][0][0]
    if isinstance(cell, list):
        return "tree:" + ":".join(map(str, cell))
    return f"static:{cell}" if cell else "off"


def _is_uniform(params: dict) -> bool:
    cells = [c for plane in params["k"] for row in plane for c in row]
    return all(c == cells[0] for c in cells)


def vllm_table(pf: PolicyFile, max_batch: int, acceptance: float, context: int = 1024) -> dict:
    """The learned draft length by batch size in vLLM's `num_speculative_tokens_per_batch_size`
    form: [[start_bs, end_bs, K], ...], ranges from 1 to max_batch (K = 0: speculation off).
    vLLM picks by batch size only: a table with context buckets gives those of `context`
    tokens per sequence."""
    if pf.kind == "twostate":
        on, k = pf.params["max_batch_on"], pf.params["k"]
        ranges = ([[1, min(on, max_batch), k]] if on >= 1 else []) + (
            [[on + 1, max_batch, 0]] if on < max_batch else []
        )
    else:
        edges, ae = pf.params["batch_edges"], pf.params["accept_edges"]
        row = min(max(int(np.searchsorted(ae, acceptance, side="right")) - 1, 0), len(ae) - 2)
        ks = pf.params["k"][row]
        if "ctx_edges" in pf.params:
            ks = ks[int(np.searchsorted(pf.params["ctx_edges"], context, side="right")) - 1]
        ranges = []
        for i, lo in enumerate(edges):
            hi = min(edges[i + 1] - 1 if i + 1 < len(edges) else max_batch, max_batch)
            if lo > max_batch:
                break
            if ranges and ranges[-1][2] == ks[i]:
                ranges[-1][1] = hi
            else:
                ranges.append([lo, hi, ks[i]])
    return {"num_speculative_tokens_per_batch_size": ranges}


def engine_facts(cfg: SimConfig, model_path: str | None = None, drafter_path: str | None = None) -> EngineFacts:
    """The vLLM engine a policy learned on `cfg` runs in: its first drafter, longest draft, batch
    limit, tensor parallelism, memory and window (the workload's longest prompt and response).
    The target is `model_path` (default: the model's name); a draft model or an EAGLE-3 head is
    `drafter_path` (default: a draft model's preset name, a marked placeholder for a head's folder)."""
    d = cfg.drafters[0]
    if d.kind == "ngram":
        drafter_path = None
    elif not drafter_path:
        model = d.model.name if d.model is not None else d.name
        drafter_path = model if d.kind == "model" else EAGLE_PLACEHOLDER.format(model=cfg.model.name)
    return EngineFacts(
        model=model_path or cfg.model.name,
        drafter=d.kind,
        drafter_path=drafter_path,
        k_max=cfg.speculation.k_max,
        max_num_seqs=cfg.cluster.max_batch,
        tensor_parallel_size=cfg.cluster.tp,
        gpu_memory_utilization=cfg.cluster.gpu_memory_utilization,
        max_model_len=length_max(cfg.workload.prompt_len) + length_max(cfg.workload.response_len),
    )


def default_trace_dir(policy_file: Path) -> Path:
    """Where a learned policy's engines write their traces by default: `STEM-traces` beside
    the policy file (an engine-core trace folder: fit, replay, plot and report read it)."""
    return policy_file.resolve().parent / f"{policy_file.stem}-traces"


def framework_snippets(facts: EngineFacts, kind: PolicyKind, policy_file: Path, trace_dir: Path) -> dict[Path, str]:
    """The files that run the learned policy file in vLLM, verl and OpenRLHF (`engine_args.
    framework_files`), {path beside the policy file: text}; the policy and the trace folder as
    absolute paths, for engines started elsewhere. The policy file must be written."""
    hook = HookSettings(f"{kind}:{policy_file.resolve()}", trace_dir=str(trace_dir.resolve()))
    files = framework_files(facts, hook, policy_file.stem)
    return {policy_file.parent / name: text for name, text in files.items()}
