"""vLLM's speculative-decoding metrics as rlsched step traces (`rlsched import-vllm`).

vLLM (0.32) keeps Prometheus counters and histograms, not per-step records. A SEQUENCE of
snapshots of them (after each `generate` call, or periodic scrapes of `/metrics`) is turned
into one step record per interval between snapshots (the counters' deltas), which
`rlsched fit` reads like a run folder. No torch, no vllm: this module only parses data.

Inputs (the format is found from the content):
- METRICS.json, written by bench/peers/vllm_spec_metrics.py:
  `{"format": "rlsched-vllm-metrics", "version": 1, "vllm": "0.32.0", "config": {...},
  "snapshots": [{"run": 0, "label": "k2-b16", "time_s": 12.3, "record": true, "batch": 16,
  "k": 2, "drafter": "model", "metrics": [METRIC, ...]}, ...]}`, where METRIC is one object of
  `LLM.get_metrics()` (vllm/v1/metrics/reader.py) as JSON: `{"name", "labels": {...}, "type"}`
  plus `"value"` (counter, gauge), `"values"` (vector: accepted tokens per draft position) or
  `"count", "sum", "buckets": {le: cumulative count}` (histogram). Every snapshot field but
  `metrics` is optional; a bare list of snapshots, or one bare `get_metrics()` list (one
  snapshot), is read too.
- METRICS.prom: Prometheus text exposition (what `/metrics` serves). Several scrapes go in
  one file, each after a line `# rlsched-snapshot {JSON of the snapshot's fields}` (a comment
  to any other Prometheus reader); a file without such lines is one snapshot.

Snapshots of one `run` (one engine: its counters start at zero) are diffed in order; a run's
first snapshot is diffed against the engine's start (all zero), and one marked
`"record": false` only serves as the next one's baseline. Counters that go backwards within
a run (a restarted engine not marked as a new run) are an error.

Per interval and engine (label `engine` -> `instance`): one `decode` record (kind decode,
`source` = "vllm", `steps` = the decode steps it sums, plus `run`, `label`, `num_drafts`,
`batch_mean`, `k_mean`) and, for a plain engine (k = 0) whose interval started requests, one
`prefill` record. DIR/vllm.json holds every interval, acceptance per draft position and the
SD speedup against k = 0 at the same batch. What is what:
- exact (counter deltas): `drafted` (num_draft_tokens), `accepted` (num_accepted_tokens; vLLM
  also counts drafts accepted past a stop), `num_drafts` (rows that drafted, summed over steps),
  acceptance per draft position, `emitted` (generation tokens less each new request's first
  token, which its prefill step makes), engine steps (one iteration_tokens_total observation
  per step with output), the prefill's `batch` (requests started) and `ctx_tokens` (their
  prompt tokens), `k` (the snapshot's, else the number of positions vLLM counts acceptance at,
  i.e. num_speculative_tokens, else --k).
- exact where every request of the interval runs in every decode step (`batch_constant` in
  vllm.json: plain decoding of equal lengths, as bench/peers/vllm_spec_metrics.py
  --ignore-eos does), means otherwise: decode `steps` = engine steps less one prefill step (an
  interval's new requests are taken to be prefilled together, true when the token budget holds
  their prompts); `batch` = row-steps / steps, rounded (row-steps: the inter-token-latency
  observations, one per running request per decode step; `batch_mean` keeps the ratio);
  `step_ms` = the mean inter-token latency (the decode step's period between the engine core's
  timestamps; weighted by rows when the batch shrinks). With speculation the batch shrinks at
  the end even for equal lengths: rows accept different numbers of tokens and finish apart.
- approximate: a decode record's `ctx_tokens` (rows x (mean prompt + half the mean generated
  length)); the prefill's `step_ms` (vLLM's per-request prefill time, scheduled -> first token,
  averaged: the prefill step's period when the prompts are prefilled together); `time_s` (the
  snapshot's time, i.e. the interval's end, else the interval's index); the SD speedup
  (tokens per second of whole generate calls, `generate_s`, prefill included).
- not in the metrics: draft time apart from verify time. A plain step is all verify, so its
  `verify_ms` = `step_ms`; a speculative step's time holds both, so its `draft_ms` and
  `verify_ms` are NaN and only `step_ms` is set. An SD engine's prefill step also prefills the
  draft model, so it gives no prefill record (vllm.json keeps its time). `rlsched fit DIR`
  therefore fits verify at q = 1 (the plain steps) and prefill, and prices no drafter (it
  counts the speculative intervals among the decode steps it leaves out).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from rlsched.errors import UserError

FORMAT, VERSION = "rlsched-vllm-metrics", 1
SUMMARY_KIND, SUMMARY_VERSION = "rlsched-vllm-import", 1
SUMMARY_FILE = "vllm.json"
MARKER = "# rlsched-snapshot"

PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
SPEC = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
}
COUNTERS = {
    **SPEC,
    "generation_tokens": "vllm:generation_tokens",
    "prompt_tokens": "vllm:prompt_tokens",
    "finished": "vllm:request_success",
    "preemptions": "vllm:num_preemptions",
}
HISTOGRAMS = {
    "steps": "vllm:iteration_tokens_total",
    "itl": "vllm:inter_token_latency_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}
GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting"}
NEEDED = sorted({PER_POS, *COUNTERS.values(), *HISTOGRAMS.values(), *GAUGES.values()})

EXACT = [
    "drafted, accepted, num_drafts and acceptance per draft position (counter deltas)",
    "emitted: generation tokens less each new request's first token (made by its prefill step)",
    "engine steps (one iteration_tokens_total observation per step with output)",
    "prefill batch (requests started) and ctx_tokens (their prompt tokens)",
    "k: the snapshot's, else the positions vLLM counts acceptance at (num_speculative_tokens), else --k",
]
EXACT_IF_CONSTANT = [
    "decode steps = engine steps - 1 prefill step per interval with new requests",
    "batch = inter-token-latency observations (row-steps) / decode steps",
    "step_ms = mean inter-token latency (the decode step's period); row-weighted when the batch shrinks",
]
APPROXIMATE = [
    "decode ctx_tokens: rows x (mean prompt + half the mean generated length)",
    "prefill step_ms: mean per-request prefill time (scheduled -> first token)",
    "time_s: the snapshot's time (the interval's end), else the interval's index",
    "SD speedup: tokens per second of whole generate calls (generate_s, prefill included) against k = 0",
]
NOT_AVAILABLE = (
    "vLLM's metrics do not separate draft time from verify time: a speculative step's draft_ms and "
    "verify_ms are NaN (step_ms holds both); rlsched fit prices verify from the plain (k = 0) steps "
    "and prefill, and no drafter (its note counts the speculative intervals among the decode steps "
    "it leaves out)"
)


def _bad(path, what: str, fix: str) -> UserError:
    return UserError(f"import-vllm: '{path}' {what}; {fix}")


# ----------------------------------------------------------------------------- Prometheus text

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,?)')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _parse_sample(line: str) -> tuple[str, dict, float]:
    """`name{a="x",b="y"} value [timestamp]` -> (name, labels, value); ValueError if malformed."""
    m = _NAME.match(line)
    if m is None:
        raise ValueError("no metric name")
    name, pos, labels = m.group(0), m.end(), {}
    if pos < len(line) and line[pos] == "{":
        pos += 1
        while True:
            rest = line[pos:].lstrip()
            if rest.startswith("}"):
                pos = len(line) - len(rest) + 1
                break
            lm = _LABEL.match(line, pos)
            if lm is None:
                raise ValueError("malformed labels")
            labels[lm.group(1)] = re.sub(r"\\[\\\"n]", lambda e: _ESCAPES[e.group(0)], lm.group(2))
            pos = lm.end()
            if not lm.group(3) and not line[pos:].lstrip().startswith("}"):
                raise ValueError("malformed labels")
    parts = line[pos:].split()
    if not parts or len(parts) > 2:
        raise ValueError("no value")
    return name, labels, float(parts[0])


def _family(name: str, labels: dict, types: dict) -> tuple[str, str, str] | None:
    """(family, kind, part) of a sample: kind counter | gauge | histogram; part is the
    histogram's bucket | count | sum. None for samples to skip (`_created`)."""
    for suffix in ("_bucket", "_count", "_sum"):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            if types.get(base) == "histogram" or (suffix == "_bucket" and "le" in labels):
                return base, "histogram", suffix[1:]
    if name.endswith("_created"):
        return None
    if name.endswith("_total"):
        return name[: -len("_total")], "counter", ""
    kind = types.get(name, "gauge")
    return name, ("counter" if kind == "counter" else "gauge"), ""


def parse_prometheus(text: str, where: str = "the text", first_line: int = 1) -> list[dict]:
    """One Prometheus scrape -> vLLM metric objects as JSON (what `LLM.get_metrics()` gives:
    vllm:* only; `_total` counters under their family name; the per-position counter as one
    vector; histograms with buckets, count and sum). ValueError naming the line (numbered from
    `first_line`) if malformed."""
    types: dict[str, str] = {}
    scalars: dict[tuple, dict] = {}
    hists: dict[tuple, dict] = {}
    vectors: dict[tuple, dict] = {}
    for no, raw in enumerate(text.splitlines(), first_line):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                types[parts[2]] = parts[3].strip()
            continue
        try:
            name, labels, value = _parse_sample(line)
        except ValueError as e:
            raise ValueError(f"{where}, line {no}: {e}: {line[:80]!r}") from None
        if not name.startswith("vllm:"):
            continue
        fam = _family(name, labels, types)
        if fam is None:
            continue
        family, kind, part = fam
        if kind == "histogram":
            le = labels.pop("le", None)
            key = (family, tuple(sorted(labels.items())))
            h = hists.setdefault(
                key, {"name": family, "type": "histogram", "labels": labels, "count": None, "sum": None, "buckets": {}}
            )
            if part == "bucket":
                if le is None:
                    raise ValueError(f"{where}, line {no}: a histogram bucket without an 'le' label")
                h["buckets"][le] = value
            else:
                h[part] = value
        elif family == PER_POS:
            p = labels.pop("position", None)
            if p is None or not p.isdigit():
                raise ValueError(f"{where}, line {no}: {PER_POS} without a numeric 'position' label")
            key = (family, tuple(sorted(labels.items())))
            vectors.setdefault(key, {"name": family, "type": "vector", "labels": labels, "by_pos": {}})
            vectors[key]["by_pos"][int(p)] = value
        else:
            key = (family, tuple(sorted(labels.items())))
            if key in scalars:
                raise ValueError(
                    f"{where}, line {no}: the series {family} {labels} appears twice; separate "
                    f"scrapes with '{MARKER} {{}}' lines"
                )
            scalars[key] = {"name": family, "type": kind, "labels": labels, "value": value}
    out = list(scalars.values())
    for v in vectors.values():
        by_pos = v.pop("by_pos")
        v["values"] = [by_pos.get(i, 0.0) for i in range(max(by_pos) + 1)]
        out.append(v)
    for h in hists.values():
        if h["count"] is None:
            h["count"] = h["buckets"].get("+Inf", 0.0)
        if h["sum"] is None:
            raise ValueError(f"{where}: histogram {h['name']} has no _sum sample")
        out.append(h)
    return out


# ----------------------------------------------------------------------------- reading snapshots


@dataclass
class Snapshot:
    meta: dict
    metrics: list[dict]
    where: str  # for messages: "snapshot 3 ('k2-b16')"


@dataclass
class Source:
    path: Path
    format: str  # json | prometheus
    snapshots: list[Snapshot]
    info: dict = field(default_factory=dict)  # vllm version, config


def _check_metric(m, path, where: str) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("name"), str):
        raise _bad(
            path,
            f"{where}: a metric is not an object with a 'name'",
            "give LLM.get_metrics() objects as JSON (name, labels, value | values | count/sum/buckets)",
        )
    labels = m.get("labels") or {}
    if not isinstance(labels, dict):
        raise _bad(path, f"{where}: metric {m['name']} has labels that are not an object", "labels: {name: value}")
    num = (int, float)
    kind = m.get("type")
    if kind not in ("counter", "gauge", "vector", "histogram"):
        kind = (
            "vector"
            if "values" in m
            else "histogram"
            if "buckets" in m or "count" in m
            else "counter"
            if m["name"] in COUNTERS.values()
            else "gauge"
        )
    ok = {
        "vector": lambda: isinstance(m.get("values"), list) and all(isinstance(v, num) for v in m["values"]),
        "histogram": lambda: isinstance(m.get("count"), num) and isinstance(m.get("sum"), num),
    }.get(kind, lambda: isinstance(m.get("value"), num) and not isinstance(m.get("value"), bool))
    if not ok():
        raise _bad(
            path,
            f"{where}: metric {m['name']} ({kind}) lacks its numbers",
            "a counter or gauge needs 'value', a vector 'values', a histogram 'count' and 'sum'",
        )
    return {**m, "type": kind, "labels": {str(k): str(v) for k, v in labels.items()}}


def _snapshot(item, i: int, path) -> Snapshot:
    if isinstance(item, list):
        meta, metrics = {}, item
    elif isinstance(item, dict) and isinstance(item.get("metrics"), list):
        meta = {k: v for k, v in item.items() if k != "metrics"}
        metrics = item["metrics"]
    else:
        raise _bad(
            path,
            f"snapshot {i} is neither a list of metrics nor an object with 'metrics'",
            'write {"snapshots": [{"metrics": LLM.get_metrics() as JSON, ...}, ...]}',
        )
    where = f"snapshot {i}" + (f" ('{meta['label']}')" if meta.get("label") is not None else "")
    return Snapshot(meta, [_check_metric(m, path, where) for m in metrics], where)


def _read_json(doc, path) -> Source:
    info = {}
    if isinstance(doc, dict):
        if doc.get("format") not in (None, FORMAT):
            raise _bad(
                path,
                f"has format '{doc.get('format')}', not '{FORMAT}'",
                "give the JSON written by bench/peers/vllm_spec_metrics.py",
            )
        if isinstance(doc.get("version"), int) and doc["version"] > VERSION:
            raise _bad(
                path,
                f"has version {doc['version']}; this rlsched reads version {VERSION}",
                "upgrade rlsched or re-record the metrics",
            )
        info = {k: doc[k] for k in ("vllm", "torch", "config", "created_utc") if k in doc}
        if isinstance(doc.get("snapshots"), list):
            items = doc["snapshots"]
        elif isinstance(doc.get("metrics"), list):
            items = [doc]
        else:
            raise _bad(
                path,
                "is a JSON object without 'snapshots'",
                'give {"snapshots": [...]} (bench/peers/vllm_spec_metrics.py) or LLM.get_metrics() as JSON',
            )
    elif isinstance(doc, list):
        one = bool(doc) and all(isinstance(m, dict) and "name" in m for m in doc)
        items = [doc] if one else doc
    else:
        raise _bad(path, "holds JSON that is neither an object nor a list", "give METRICS.json or METRICS.prom")
    if not items:
        raise _bad(path, "holds no snapshots", "record LLM.get_metrics() after each generate call")
    return Source(Path(path), "json", [_snapshot(x, i, path) for i, x in enumerate(items)], info)


def _read_prom(text: str, path) -> Source:
    blocks: list[tuple[dict, str, int]] = []
    meta, start, lines = None, 1, []
    for no, line in enumerate(text.splitlines(), 1):
        if line.startswith(MARKER):
            if meta is not None or any(s.strip() and not s.startswith("#") for s in lines):
                blocks.append((meta or {}, "\n".join(lines), start))
            try:
                meta = json.loads(line[len(MARKER) :].strip() or "{}")
            except json.JSONDecodeError:
                meta = None
            if not isinstance(meta, dict):
                raise _bad(
                    path,
                    f"line {no}: '{MARKER}' is not followed by a JSON object",
                    f'write \'{MARKER} {{"run": 0, "time_s": ...}}\'',
                )
            start, lines = no + 1, []
        else:
            lines.append(line)
    blocks.append((meta or {}, "\n".join(lines), start))
    snaps = []
    for i, (meta, body, first) in enumerate(blocks):
        where = f"scrape {i}" + (f" ('{meta['label']}')" if meta.get("label") is not None else "")
        try:
            metrics = parse_prometheus(body, where, first)
        except ValueError as e:
            raise _bad(path, f"is not valid Prometheus text ({e})", "give a /metrics scrape or METRICS.json") from None
        if not metrics and not meta:
            continue
        snaps.append(Snapshot(meta, metrics, where))
    if not snaps:
        raise _bad(path, "holds no vllm:* metrics", "give a scrape of vLLM's /metrics (vLLM run with stats logging on)")
    return Source(Path(path), "prometheus", snaps, {})


def read_source(path) -> Source:
    """The snapshots of a METRICS.json or METRICS.prom file (UserError naming the file if bad)."""
    path = Path(path)
    if not path.is_file():
        raise _bad(
            path,
            "does not exist" if not path.exists() else "is not a file",
            "give METRICS.json (bench/peers/vllm_spec_metrics.py) or a Prometheus scrape (.prom)",
        )
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise _bad(path, "is not text", "give METRICS.json or Prometheus text") from None
    head = text.lstrip()[:1]
    if head in ("{", "["):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise _bad(
                path,
                f"is not valid JSON (line {e.lineno}: {e.msg})",
                "re-record it (a run cut short leaves a partial file)",
            ) from None
        return _read_json(doc, path)
    if not head:
        raise _bad(path, "is empty", "give METRICS.json or a Prometheus scrape")
    return _read_prom(text, path)


# ----------------------------------------------------------------------------- totals and deltas


def _engine(labels: dict) -> str:
    return labels.get("engine", "0")


def engine_totals(snap: Snapshot) -> dict[str, dict]:
    """Per engine label: the counters, histograms (count, sum), gauges and the per-position
    vector this module reads, summed over other labels (model_name, finished_reason, ...)."""
    names = {v: k for k, v in {**COUNTERS, **GAUGES}.items()}
    hnames = {v: k for k, v in HISTOGRAMS.items()}
    out: dict[str, dict] = {}
    for m in snap.metrics:
        t = out.setdefault(_engine(m["labels"]), {})
        if m["name"] in names and m["type"] in ("counter", "gauge"):
            key = names[m["name"]]
            t[key] = t.get(key, 0.0) + float(m["value"])
        elif m["name"] in hnames and m["type"] == "histogram":
            key = hnames[m["name"]]
            c, s = t.get(key, (0.0, 0.0))
            t[key] = (c + float(m["count"]), s + float(m["sum"]))
        elif m["name"] == PER_POS and m["type"] == "vector":
            prev = t.get("per_pos", [])
            vals = [float(v) for v in m["values"]]
            n = max(len(prev), len(vals))
            t["per_pos"] = [(prev[i] if i < len(prev) else 0.0) + (vals[i] if i < len(vals) else 0.0) for i in range(n)]
    return {e: t for e, t in out.items() if t}


def _delta(cur: dict, prev: dict, path, where: str, engine: str) -> dict:
    """cur - prev per quantity (absent before = 0); UserError if a counter went backwards."""
    d = {}
    for key, v in cur.items():
        if key in GAUGES:
            d[key] = v
            continue
        p = prev.get(key)
        if key == "per_pos":
            p = p or [0.0] * len(v)
            if len(p) != len(v):
                raise _bad(
                    path,
                    f"{where}: engine {engine}'s {PER_POS} has {len(v)} positions, before {len(p)}",
                    'an engine with another num_speculative_tokens is a new run: give its snapshots their own "run"',
                )
            diff = [a - b for a, b in zip(v, p)]
            bad = min(diff) < -1e-9
        elif isinstance(v, tuple):
            p = p or (0.0, 0.0)
            diff = (v[0] - p[0], v[1] - p[1])
            bad = diff[0] < -1e-9 or diff[1] < -1e-9
        else:
            diff = v - (p or 0.0)
            bad = diff < -1e-9
        if bad:
            name = {**COUNTERS, **HISTOGRAMS, "per_pos": PER_POS}[key]
            raise _bad(
                path,
                f"{where}: counter {name} of engine {engine} goes backwards ({p} -> {v})",
                'the engine restarted: give each engine\'s snapshots their own "run" (or split the file); '
                "in Prometheus text, start a new run with a '# rlsched-snapshot {\"run\": N}' line",
            )
        d[key] = diff
    return d


def _num(x, default=None):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else default


@dataclass
class Imported:
    steps: pd.DataFrame
    summary: dict


def build(source: Source, k: int | None = None, drafter: str | None = None, *, require_spec: bool = True) -> Imported:
    """Step records and summary of a source's snapshots (see the module docstring).
    `require_spec=False` also takes an engine that never drafted (the vLLM rollout backend
    with policy off: its plain decode and prefill records are what `rlsched fit` needs)."""
    path = source.path
    if require_spec and not any(
        ("drafts" in t or "per_pos" in t) for s in source.snapshots for t in engine_totals(s).values()
    ):
        raise _bad(
            path,
            "holds no speculative-decoding metrics (vllm:spec_decode_*)",
            "run vLLM with a speculative_config and stats logging on (LLM(..., disable_log_stats=False))",
        )
    prev: dict[tuple, tuple] = {}  # (run, engine) -> (totals, snapshot)
    rows, intervals, notes, varied = [], [], [], []
    for idx, snap in enumerate(source.snapshots):
        meta = snap.meta
        run = meta.get("run", 0)
        run_key = str(run)
        for engine, tot in sorted(engine_totals(snap).items()):
            before = prev.get((run_key, engine), ({}, None))[0]
            d = _delta(tot, before, path, snap.where, engine)
            prev[(run_key, engine)] = (tot, snap)
            if meta.get("record", True) is False:
                continue
            rec = _interval(d, tot, meta, snap, idx, engine, path, k, drafter, notes, varied)
            if rec is None:
                continue
            rows.extend(rec["records"])
            intervals.append(rec["interval"])
    if not rows:
        raise _bad(
            path,
            "holds no interval with engine steps to import",
            "take a snapshot after each generate call (the first snapshot of a run is diffed against zero)",
        )
    if varied:
        notes.append(
            f"the batch shrank within {len(varied)} interval(s) ({', '.join(varied)}): requests finished at "
            "different steps, so their batch, step_ms and ctx_tokens are averages over the decode steps"
        )
    steps = pd.DataFrame(rows)
    steps["step"] = range(len(steps))
    summary = _summary(source, intervals, notes)
    return Imported(steps, summary)


def _resolve_k(d: dict, tot: dict, meta: dict, path, where: str, k_cli: int | None) -> int:
    n_pos = len(tot["per_pos"]) if "per_pos" in tot else None
    k_meta = meta.get("k")
    if k_meta is not None and (not isinstance(k_meta, int) or k_meta < 0):
        raise _bad(path, f"{where}: k = {k_meta!r} is not a whole number >= 0", 'fix the snapshot\'s "k"')
    for given, what in ((k_meta, "the snapshot's k"), (k_cli, "--k")):
        if given is not None and n_pos is not None and given != n_pos:
            raise _bad(
                path,
                f"{where}: {what} = {given} but vLLM counted acceptance at {n_pos} draft positions "
                "(num_speculative_tokens)",
                'drop --k (the file says k) or fix the snapshot\'s "k"',
            )
    if k_meta is not None:
        return k_meta
    if n_pos is not None:
        return n_pos
    if k_cli is not None:
        return k_cli
    if d.get("drafts", 0) > 0:
        raise _bad(
            path,
            f"{where}: drafts were made but the draft length is not known (no {PER_POS})",
            "give --k K (vLLM's num_speculative_tokens)",
        )
    return 0


def _interval(d, tot, meta, snap, idx, engine, path, k_cli, drafter_cli, notes, varied) -> dict | None:
    steps_all = int(round(d.get("steps", (0.0, 0.0))[0]))
    first = int(round(d.get("ttft", (0.0, 0.0))[0]))
    row_steps, itl_s = d.get("itl", (0.0, 0.0))
    row_steps = int(round(row_steps))
    label = meta.get("label", f"snapshot {idx}")
    if not (steps_all or row_steps or first or d.get("generation_tokens", 0) > 0):
        notes.append(f"{snap.where}: engine {engine} ran no steps in the interval; skipped")
        return None
    lacking = [HISTOGRAMS[h] for h in ("steps", "itl", "ttft") if h not in d]
    if lacking:
        raise _bad(
            path,
            f"{snap.where}: engine {engine} lacks {', '.join(lacking)}",
            "keep vLLM's histograms in the dump (they give the engine steps and the step time)",
        )
    k = _resolve_k(d, tot, meta, path, snap.where, k_cli)
    drafter = "off" if k == 0 else (drafter_cli or meta.get("drafter") or "vllm")
    prefill_steps = 1 if first > 0 else 0
    decode_steps = steps_all - prefill_steps
    instance = int(engine) if str(engine).isdigit() else 0
    t = _num(meta.get("time_s"), float(idx))
    gen = d.get("generation_tokens", 0.0)
    prompt = d.get("prompt_tokens", 0.0)
    drafts = int(round(d.get("drafts", 0.0)))
    drafted = int(round(d.get("draft_tokens", 0.0)))
    accepted = int(round(d.get("accepted", 0.0)))
    base = dict(
        rl_step=0, instance=instance, time_s=t, width=1, source="vllm", run=str(meta.get("run", 0)), label=str(label)
    )
    records, interval = (
        [],
        {
            "label": str(label),
            "run": str(meta.get("run", 0)),
            "instance": instance,
            "k": k,
            "drafter": drafter,
            "engine_steps": steps_all,
            "new_requests": first,
            "finished_requests": int(round(d.get("finished", 0.0))),
        },
    )
    if meta.get("batch") is not None:
        interval["batch_requested"] = meta["batch"]
    gs = _num(meta.get("generate_s"))
    if gs and gs > 0:
        interval.update(generate_s=gs, tokens_per_s=gen / gs)
    # the mean prompt and generated length of this interval's requests (else of the run so far)
    n_req = first if first > 0 else _num(tot.get("ttft", (0, 0))[0], 0)
    mean_prompt = (prompt if first > 0 else tot.get("prompt_tokens", 0.0)) / n_req if n_req else 0.0
    mean_gen = (gen if first > 0 else tot.get("generation_tokens", 0.0)) / n_req if n_req else 0.0
    if first > 0:
        pc, ps = d.get("prefill", (0.0, 0.0))
        prefill_ms = 1e3 * ps / pc if pc > 0 else math.nan
        interval.update(prefill_ms=prefill_ms, prompt_tokens=int(round(prompt)))
        if k == 0:  # an SD engine's prefill step also prefills its draft model: not the target's prefill
            records.append(
                dict(
                    base,
                    kind="prefill",
                    batch=first,
                    drafter="off",
                    k=0,
                    drafted=0,
                    accepted=0,
                    emitted=first,
                    draft_ms=0.0,
                    verify_ms=prefill_ms,
                    step_ms=prefill_ms,
                    ctx_tokens=int(round(prompt)),
                    steps=prefill_steps,
                    num_drafts=0,
                    batch_mean=float(first),
                    k_mean=0.0,
                )
            )
    if decode_steps > 0 and row_steps > 0:
        batch_mean = row_steps / decode_steps
        batch = max(1, math.floor(batch_mean + 0.5))
        step_ms = 1e3 * itl_s / row_steps
        emitted = int(round(gen)) - first
        ctx = int(round(batch_mean * (mean_prompt + mean_gen / 2)))
        records.append(
            dict(
                base,
                kind="decode",
                batch=batch,
                drafter=drafter,
                k=k,
                drafted=drafted,
                accepted=accepted,
                emitted=emitted,
                draft_ms=0.0 if k == 0 else math.nan,
                verify_ms=step_ms if k == 0 else math.nan,
                step_ms=step_ms,
                ctx_tokens=ctx,
                steps=decode_steps,
                num_drafts=drafts,
                batch_mean=batch_mean,
                k_mean=drafted / drafts if drafts else 0.0,
            )
        )
        interval.update(
            decode_steps=decode_steps,
            batch=batch,
            batch_mean=batch_mean,
            step_ms=step_ms,
            drafts=drafts,
            drafted=drafted,
            accepted=accepted,
            emitted=emitted,
            ctx_tokens=ctx,
        )
        if k > 0:
            pos = [int(round(v)) for v in d.get("per_pos", [])]
            interval.update(
                acceptance=accepted / drafted if drafted else None,
                accepted_per_position=pos or None,
                per_position=[v / drafts for v in pos] if drafts and pos else None,
            )
        constant = first > 0 and row_steps == first * decode_steps
        interval["batch_constant"] = constant
        if not constant:
            varied.append(str(label))
    if not records:
        notes.append(f"{snap.where}: engine {engine} made no decode steps in the interval; skipped")
        return None
    return {"records": records, "interval": interval}


def _acceptance(intervals: list[dict]) -> list[dict]:
    """Per (drafter, k), over the recorded intervals: acceptance rate, mean accepted length per
    draft (bonus token included) and acceptance per draft position (the share of drafts whose
    position i was accepted) with its conditional form (given position i - 1 was)."""
    acc: dict[tuple, dict] = {}
    for iv in intervals:
        if iv["k"] == 0 or "drafts" not in iv:
            continue
        a = acc.setdefault(
            (iv["drafter"], iv["k"]),
            {
                "drafter": iv["drafter"],
                "k": iv["k"],
                "drafts": 0,
                "draft_tokens": 0,
                "accepted": 0,
                "accepted_per_position": None,
            },
        )
        a["drafts"] += iv["drafts"]
        a["draft_tokens"] += iv["drafted"]
        a["accepted"] += iv["accepted"]
        pos = iv.get("accepted_per_position")
        if pos:
            have = a["accepted_per_position"]
            a["accepted_per_position"] = pos if have is None else [x + y for x, y in zip(have, pos)]
    out = []
    for a in acc.values():
        n, pos = a["drafts"], a["accepted_per_position"]
        a["acceptance"] = a["accepted"] / a["draft_tokens"] if a["draft_tokens"] else None
        a["mean_accepted_length"] = 1 + a["accepted"] / n if n else None
        a["per_position"] = [c / n for c in pos] if pos and n else None
        a["per_position_conditional"] = (
            ([pos[0] / n] + [pos[i] / pos[i - 1] if pos[i - 1] else None for i in range(1, len(pos))])
            if pos and n
            else None
        )
        out.append(a)
    return out


def _summary(source: Source, intervals: list[dict], notes: list[str]) -> dict:
    # SD against plain decoding at the same requested batch: generate-call throughput (wall clock,
    # prefill included), where the snapshots say how long their generate call took
    plain = {
        iv["batch_requested"]: iv["tokens_per_s"]
        for iv in intervals
        if iv["k"] == 0 and iv.get("tokens_per_s") and iv.get("batch_requested") is not None
    }
    for iv in intervals:
        base = plain.get(iv.get("batch_requested"))
        if iv["k"] > 0 and base and iv.get("tokens_per_s"):
            iv["speedup_vs_k0"] = iv["tokens_per_s"] / base
    return {
        "kind": SUMMARY_KIND,
        "version": SUMMARY_VERSION,
        "source": str(source.path.resolve()),
        "input_format": source.format,
        **{k: v for k, v in source.info.items()},
        "snapshots": len(source.snapshots),
        "intervals": intervals,
        "acceptance": _acceptance(intervals),
        "exact": EXACT,
        "exact_if_batch_constant": EXACT_IF_CONSTANT,
        "approximate": APPROXIMATE,
        "not_available": NOT_AVAILABLE,
        "notes": notes,
    }


# ----------------------------------------------------------------------------- writing


def check_out(out: Path) -> None:
    """Refuse an --out that is a file, or a non-empty folder that is not an earlier import."""
    out = Path(out)
    if out.exists():
        if not out.is_dir():
            raise UserError(f"import-vllm: --out '{out}' is a file; give a folder")
        if any(out.iterdir()) and not (out / SUMMARY_FILE).is_file():
            raise UserError(
                f"import-vllm: --out '{out}' is a non-empty folder that is not an earlier "
                "import-vllm output; give a new or empty folder"
            )


def import_vllm(path, out, k: int | None = None, drafter: str | None = None) -> dict:
    """Read METRICS (.json or Prometheus text), write OUT/traces/steps/ and OUT/vllm.json whole
    (nothing is written when the input is bad); returns the summary."""
    from rlsched.atomic import atomic_folder, write_text_atomic
    from rlsched.traces.writer import to_table, write_table

    if k is not None and k < 0:
        raise UserError(f"import-vllm: --k must be >= 0 (got {k})")
    check_out(Path(out))
    imported = build(read_source(path), k, drafter)
    table = to_table("steps", imported.steps)
    summary = {**imported.summary, "records": int(len(imported.steps)), "out": str(Path(out))}
    summary = _clean(summary)
    with atomic_folder(Path(out)) as tmp:
        write_table(tmp / "traces" / "steps" / "part-000000.parquet", table)
        write_text_atomic(tmp / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    return summary


def report(summary: dict) -> tuple[list[str], list[list[str]], list[str]]:
    """What `rlsched import-vllm` prints: table columns, rows (one per interval) and lines."""
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    cols = [
        "interval",
        "k",
        "drafter",
        "requests",
        "rows/step",
        "decode steps",
        "step ms",
        "prefill ms",
        "drafted",
        "accepted",
        "acceptance",
        "SD speedup",
    ]
    rows = [
        [
            iv["label"],
            str(iv["k"]),
            iv["drafter"],
            str(iv["new_requests"]),
            f(iv.get("batch_mean"), ".2f"),
            str(iv.get("decode_steps", "-")),
            f(iv.get("step_ms"), ".2f"),
            f(iv.get("prefill_ms"), ".1f"),
            str(iv.get("drafted", "-")),
            str(iv.get("accepted", "-")),
            f(iv.get("acceptance"), ".3f"),
            f(iv.get("speedup_vs_k0"), ".2f") + ("x" if iv.get("speedup_vs_k0") else ""),
        ]
        for iv in summary["intervals"]
    ]
    lines = []
    for a in summary["acceptance"]:
        pos = " ".join(f(v, ".3f") for v in a["per_position"] or [])
        cond = " ".join(f(v, ".3f") for v in a["per_position_conditional"] or [])
        lines.append(
            f"acceptance per position ({a['drafter']}, k={a['k']}, {a['drafts']} drafts): {pos} "
            f"(given the previous: {cond}); mean accepted length {f(a['mean_accepted_length'], '.2f')}"
        )
    lines.append(
        "SD speedup: tokens per second of the generate call against the k = 0 one at the same batch "
        "(wall clock, where the snapshots give generate_s)"
    )
    lines.append(f"note: {NOT_AVAILABLE}")
    lines += [f"note: {n}" for n in summary["notes"]]
    lines.append(
        f"wrote {summary['records']} step records to {summary['out']}/traces/steps and {summary['out']}/{SUMMARY_FILE}"
    )
    return cols, rows, lines


def _clean(x):
    """JSON-ready: NaN and infinities as null, numpy scalars as Python numbers."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "item"):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
