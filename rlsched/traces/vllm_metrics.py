"""vLLM's speculative-decoding metrics as rlsched step traces (`rlsched import-vllm`).

vLLM (0.32) keeps Prometheus counters and histograms, not per-step records. A SEQUENCE of
snapshots of them (after each `generate` call, or periodic scrapes of `/metrics`) is turned
into one step record per interval between snapshots (the counters' deltas), which
`rlsched fit` reads like a run folder. No torch, no vllm: this module only parses data.

Inputs, METRICS.json or Prometheus text, are read and diffed in `vllm_snapshots`.

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
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from rlsched.errors import UserError
from rlsched.traces.vllm_snapshots import (
    HISTOGRAMS,
    PER_POS,
    Source,
    bad_input,
    delta,
    engine_totals,
    finite,
    json_ready,
    read_source,
)

SUMMARY_KIND, SUMMARY_VERSION = "rlsched-vllm-import", 1
SUMMARY_FILE = "vllm.json"

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
        raise bad_input(
            path,
            "holds no speculative-decoding metrics (vllm:spec_decode_*)",
            "run vLLM with a speculative_config and stats logging on (LLM(..., disable_log_stats=False))",
        )
    prev: dict[tuple, tuple] = {}  # (run, engine) -> (totals, snapshot)
    rows: list[dict] = []
    intervals: list[dict] = []
    notes: list[str] = []  # said to the user
    varied: list[str] = []  # labels of the intervals whose batch shrank
    for idx, snap in enumerate(source.snapshots):
        meta = snap.meta
        run = meta.get("run", 0)
        run_key = str(run)
        for engine, tot in sorted(engine_totals(snap).items()):
            before = prev.get((run_key, engine), ({}, None))[0]
            d = delta(tot, before, path, snap.where, engine)
            prev[(run_key, engine)] = (tot, snap)
            if meta.get("record", True) is False:
                continue
            try:
                rec = _interval(d, tot, meta, snap, idx, engine, path, k, drafter, notes, varied)
            except (OverflowError, ValueError) as e:  # numbers past float's range, or NaN, in its arithmetic
                what = f"{snap.where}: engine {engine}'s numbers are out of range ({e})"
                raise bad_input(path, what, "re-record the metrics") from None
            if rec is None:
                continue
            rows.extend(rec["records"])
            intervals.append(rec["interval"])
    if not rows:
        raise bad_input(
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
        raise bad_input(path, f"{where}: k = {k_meta!r} is not a whole number >= 0", 'fix the snapshot\'s "k"')
    for given, what in ((k_meta, "the snapshot's k"), (k_cli, "--k")):
        if given is not None and n_pos is not None and given != n_pos:
            raise bad_input(
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
        raise bad_input(
            path,
            f"{where}: drafts were made but the draft length is not known (no {PER_POS})",
            "give --k K (vLLM's num_speculative_tokens)",
        )
    return 0


def _interval(d, tot, meta, snap, idx, engine, path, k_cli, drafter_cli, notes, varied) -> dict | None:
    """One interval's step records (a prefill and a decode record) and its row of vllm.json."""
    steps_all = int(round(d.get("steps", (0.0, 0.0))[0]))
    first = int(round(d.get("ttft", (0.0, 0.0))[0]))
    row_steps = int(round(d.get("itl", (0.0, 0.0))[0]))
    label = meta.get("label", f"snapshot {idx}")
    if not (steps_all or row_steps or first or d.get("generation_tokens", 0) > 0):
        notes.append(f"{snap.where}: engine {engine} ran no steps in the interval; skipped")
        return None
    lacking = [HISTOGRAMS[h] for h in ("steps", "itl", "ttft") if h not in d]
    if lacking:
        raise bad_input(
            path,
            f"{snap.where}: engine {engine} lacks {', '.join(lacking)}",
            "keep vLLM's histograms in the dump (they give the engine steps and the step time)",
        )
    k = _resolve_k(d, tot, meta, path, snap.where, k_cli)
    drafter = "off" if k == 0 else (drafter_cli or meta.get("drafter") or "vllm")
    prefill_steps = 1 if first > 0 else 0
    decode_steps = steps_all - prefill_steps
    instance = int(engine) if str(engine).isdigit() else 0
    t = finite(meta.get("time_s"), float(idx))
    gen = d.get("generation_tokens", 0.0)
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
    gs = finite(meta.get("generate_s"))
    if gs and gs > 0:
        interval.update(generate_s=gs, tokens_per_s=gen / gs)
    if first > 0:
        records += _prefill_record(d, first, prefill_steps, k, base, interval)
    if decode_steps > 0 and row_steps > 0:
        records.append(_decode_record(d, tot, first, decode_steps, k, drafter, base, interval))
        constant = first > 0 and row_steps == first * decode_steps
        interval["batch_constant"] = constant
        if not constant:
            varied.append(str(label))
    if not records:
        notes.append(f"{snap.where}: engine {engine} made no decode steps in the interval; skipped")
        return None
    return {"records": records, "interval": interval}


def _prefill_record(d: dict, first: int, prefill_steps: int, k: int, base: dict, interval: dict) -> list[dict]:
    """The prefill record of an interval that started `first` requests (none for an SD engine,
    whose prefill step also prefills its draft model); sets the interval's prefill fields."""
    prompt = d.get("prompt_tokens", 0.0)
    pc, ps = d.get("prefill", (0.0, 0.0))
    prefill_ms = 1e3 * ps / pc if pc > 0 else math.nan
    interval.update(prefill_ms=prefill_ms, prompt_tokens=int(round(prompt)))
    if k != 0:  # an SD engine's prefill step also prefills its draft model: not the target's prefill
        return []
    return [
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
    ]


def _decode_record(d: dict, tot: dict, first: int, decode_steps: int, k: int, drafter: str, base, interval) -> dict:
    """The decode record of an interval: its mean decode step; sets the interval's decode fields."""
    row_steps, itl_s = d.get("itl", (0.0, 0.0))
    row_steps = int(round(row_steps))
    gen, prompt = d.get("generation_tokens", 0.0), d.get("prompt_tokens", 0.0)
    drafts = int(round(d.get("drafts", 0.0)))
    drafted = int(round(d.get("draft_tokens", 0.0)))
    accepted = int(round(d.get("accepted", 0.0)))
    # the mean prompt and generated length of this interval's requests (else of the run so far)
    n_req = first if first > 0 else finite(tot.get("ttft", (0, 0))[0], 0)
    mean_prompt = (prompt if first > 0 else tot.get("prompt_tokens", 0.0)) / n_req if n_req else 0.0
    mean_gen = (gen if first > 0 else tot.get("generation_tokens", 0.0)) / n_req if n_req else 0.0
    batch_mean = row_steps / decode_steps
    batch = max(1, math.floor(batch_mean + 0.5))
    step_ms = 1e3 * itl_s / row_steps
    emitted = int(round(gen)) - first
    ctx = int(round(batch_mean * (mean_prompt + mean_gen / 2)))
    record = dict(
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
    return record


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
    import pyarrow as pa

    from rlsched.atomic import atomic_folder, write_text_atomic
    from rlsched.traces.writer import to_table, write_table

    if k is not None and k < 0:
        raise UserError(f"import-vllm: --k must be >= 0 (got {k})")
    check_out(Path(out))
    imported = build(read_source(path), k, drafter)
    try:
        table = to_table("steps", imported.steps)
    except (pa.ArrowException, OverflowError, ValueError, TypeError) as e:
        raise UserError(f"import-vllm: '{path}' gives step records out of the traces' range ({e})") from None
    summary = {**imported.summary, "records": int(len(imported.steps)), "out": str(Path(out))}
    summary = json_ready(summary)
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
