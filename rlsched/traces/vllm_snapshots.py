"""vLLM metric snapshots: the files `rlsched import-vllm` reads, parsed and diffed.

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
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlsched.errors import UserError

FORMAT, VERSION = "rlsched-vllm-metrics", 1
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


def bad_input(path, what: str, fix: str) -> UserError:
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


def _real(v) -> bool:
    """A JSON number that a float holds (not a bool, not an int past float's range)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        float(v)
    except OverflowError:
        return False
    return True


def finite(x, default=None):
    """x as a finite float, else `default`."""
    return float(x) if _real(x) and math.isfinite(float(x)) else default


def _check_metric(m, path, where: str) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("name"), str):
        raise bad_input(
            path,
            f"{where}: a metric is not an object with a 'name'",
            "give LLM.get_metrics() objects as JSON (name, labels, value | values | count/sum/buckets)",
        )
    labels = m.get("labels") or {}
    if not isinstance(labels, dict):
        raise bad_input(path, f"{where}: metric {m['name']} has labels that are not an object", "labels: {name: value}")
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
        "vector": lambda: isinstance(m.get("values"), list) and all(_real(v) for v in m["values"]),
        "histogram": lambda: _real(m.get("count")) and _real(m.get("sum")),
    }.get(kind, lambda: _real(m.get("value")))
    if not ok():
        raise bad_input(
            path,
            f"{where}: metric {m['name']} ({kind}) lacks its numbers",
            "a counter or gauge needs 'value', a vector 'values', a histogram 'count' and 'sum'",
        )
    return {**m, "type": kind, "labels": {str(k): str(v) for k, v in labels.items()}}


def check_meta(meta: dict, path, where: str) -> dict:
    """A snapshot's own fields that become step records: k (a draft length the traces hold),
    batch and drafter; one UserError naming the file and the snapshot."""
    for key, least, most in (("k", 0, 2**15 - 1), ("batch", 1, 2**31 - 1)):
        v = meta.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not least <= v <= most):
            raise bad_input(path, f"{where}: {key} = {v!r} is not a whole number >= {least}", f'fix its "{key}"')
    if not isinstance(meta.get("drafter", ""), str):
        raise bad_input(path, f"{where}: drafter = {meta['drafter']!r} is not a name", 'fix its "drafter"')
    return meta


def _snapshot(item, i: int, path) -> Snapshot:
    if isinstance(item, list):
        meta, metrics = {}, item
    elif isinstance(item, dict) and isinstance(item.get("metrics"), list):
        meta = {k: v for k, v in item.items() if k != "metrics"}
        metrics = item["metrics"]
    else:
        raise bad_input(
            path,
            f"snapshot {i} is neither a list of metrics nor an object with 'metrics'",
            'write {"snapshots": [{"metrics": LLM.get_metrics() as JSON, ...}, ...]}',
        )
    where = f"snapshot {i}" + (f" ('{meta['label']}')" if meta.get("label") is not None else "")
    return Snapshot(check_meta(meta, path, where), [_check_metric(m, path, where) for m in metrics], where)


def _read_json(doc, path) -> Source:
    info = {}
    if isinstance(doc, dict):
        if doc.get("format") not in (None, FORMAT):
            raise bad_input(
                path,
                f"has format '{doc.get('format')}', not '{FORMAT}'",
                "give the JSON written by bench/peers/vllm_spec_metrics.py",
            )
        if isinstance(doc.get("version"), int) and doc["version"] > VERSION:
            raise bad_input(
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
            raise bad_input(
                path,
                "is a JSON object without 'snapshots'",
                'give {"snapshots": [...]} (bench/peers/vllm_spec_metrics.py) or LLM.get_metrics() as JSON',
            )
    elif isinstance(doc, list):
        one = bool(doc) and all(isinstance(m, dict) and "name" in m for m in doc)
        items = [doc] if one else doc
    else:
        raise bad_input(path, "holds JSON that is neither an object nor a list", "give METRICS.json or METRICS.prom")
    if not items:
        raise bad_input(path, "holds no snapshots", "record LLM.get_metrics() after each generate call")
    return Source(Path(path), "json", [_snapshot(x, i, path) for i, x in enumerate(items)], info)


def _read_prom(text: str, path) -> Source:
    blocks: list[tuple[dict, str, int]] = []
    lines: list[str]
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
                raise bad_input(
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
            raise bad_input(
                path, f"is not valid Prometheus text ({e})", "give a /metrics scrape or METRICS.json"
            ) from None
        if not metrics and not meta:
            continue
        snaps.append(Snapshot(check_meta(meta, path, where), metrics, where))
    if not snaps:
        raise bad_input(
            path, "holds no vllm:* metrics", "give a scrape of vLLM's /metrics (vLLM run with stats logging on)"
        )
    return Source(Path(path), "prometheus", snaps, {})


def read_source(path) -> Source:
    """The snapshots of a METRICS.json or METRICS.prom file (UserError naming the file if bad)."""
    path = Path(path)
    if not path.is_file():
        raise bad_input(
            path,
            "does not exist" if not path.exists() else "is not a file",
            "give METRICS.json (bench/peers/vllm_spec_metrics.py) or a Prometheus scrape (.prom)",
        )
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise bad_input(path, "is not text", "give METRICS.json or Prometheus text") from None
    except OSError as e:
        raise bad_input(path, f"cannot be read ({e.strerror or e})", "check the file's permissions") from None
    head = text.lstrip()[:1]
    if head in ("{", "["):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise bad_input(
                path,
                f"is not valid JSON (line {e.lineno}: {e.msg})",
                "re-record it (a run cut short leaves a partial file)",
            ) from None
        return _read_json(doc, path)
    if not head:
        raise bad_input(path, "is empty", "give METRICS.json or a Prometheus scrape")
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


def delta(cur: dict, prev: dict, path, where: str, engine: str) -> dict:
    """cur - prev per quantity (absent before = 0); UserError if a counter went backwards."""
    d = {}
    for key, v in cur.items():
        if key in GAUGES:
            d[key] = v
            continue
        if not all(math.isfinite(x) for x in (v if isinstance(v, (list, tuple)) else (v,))):
            name = {**COUNTERS, **HISTOGRAMS, "per_pos": PER_POS}[key]
            raise bad_input(
                path,
                f"{where}: {name} of engine {engine} is not a finite number ({v})",
                "re-record the metrics (counters and histogram counts and sums are finite)",
            )
        p = prev.get(key)
        diff: Any  # per position (a list), a histogram's (sum, count), or a number
        if key == "per_pos":
            p = p or [0.0] * len(v)
            if len(p) != len(v):
                raise bad_input(
                    path,
                    f"{where}: engine {engine}'s {PER_POS} has {len(v)} positions, before {len(p)}",
                    'an engine with another num_speculative_tokens is a new run: give its snapshots their own "run"',
                )
            diff = [a - b for a, b in zip(v, p)]
            bad = min(diff, default=0.0) < -1e-9
        elif isinstance(v, tuple):
            p = p or (0.0, 0.0)
            diff = (v[0] - p[0], v[1] - p[1])
            bad = diff[0] < -1e-9 or diff[1] < -1e-9
        else:
            diff = v - (p or 0.0)
            bad = diff < -1e-9
        if bad:
            name = {**COUNTERS, **HISTOGRAMS, "per_pos": PER_POS}[key]
            raise bad_input(
                path,
                f"{where}: counter {name} of engine {engine} goes backwards ({p} -> {v})",
                'the engine restarted: give each engine\'s snapshots their own "run" (or split the file); '
                "in Prometheus text, start a new run with a '# rlsched-snapshot {\"run\": N}' line",
            )
        d[key] = diff
    return d


def json_ready(x):
    """JSON-ready: NaN and infinities as null, numpy scalars as Python numbers."""
    if isinstance(x, dict):
        return {str(k): json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_ready(v) for v in x]
    if hasattr(x, "item"):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
