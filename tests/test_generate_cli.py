"""`rlsched generate` and `rlsched profile` end to end through the entry point: outputs,
traces, a kill -9 mid-run, and bad input (one line, exit 2, nothing written)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

import pandas as pd  # noqa: E402
from support import ok, rlsched, snapshot  # noqa: E402

from rlsched.traces.reader import read_trace  # noqa: E402
from rlsched.traces.schema import SAMPLE_SCHEMA, STEP_SCHEMA  # noqa: E402

pytestmark = pytest.mark.e2e  # minutes of end-to-end runs: `make test`, not `make test-fast`

FAST = ["--n", "2", "--max-tokens", "24", "--max-batch", "8", "--k-max", "3"]


def _prompts(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_generate_writes_samples_traces_and_summary(pair, tmp_path):
    prompts = _prompts(
        tmp_path / "p.jsonl",
        ['{"prompt": "count 3 to 9=", "id": "a", "answer": "3 4 5 6 7 8 9"}', '{"prompt": "rev abc="}'],
    )
    out = tmp_path / "gen"
    proc = ok(
        rlsched(
            "generate",
            "--prompts",
            str(prompts),
            "--policy",
            "static:3",
            *FAST,
            "--out",
            str(out),
            "--json",
            cwd=tmp_path,
        )
    )
    summary = json.loads(proc.stdout)
    assert summary["samples"] == 4 and summary["drafter"] == "model" and summary["mean_accept_len"] > 1.0
    df = pd.read_parquet(out / "samples.parquet")
    assert list(df.prompt_key) == ["a", "a", "2", "2"]
    tok = __import__("tokenizers").Tokenizer.from_file(str(pair.target / "tokenizer.json"))
    for _, r in df.iterrows():
        assert len(r.token_ids) == len(r.logprobs) == r.response_len <= 24
        assert all(lp <= 0 for lp in r.logprobs)
        assert r.text == tok.decode(list(r.token_ids), skip_special_tokens=True)
    assert df.correct.iloc[2:].isna().all() and df.correct.iloc[:2].notna().all()
    steps = read_trace(out / "traces", "steps")
    samples = read_trace(out / "traces", "samples")
    assert set(STEP_SCHEMA.names) <= set(steps.columns) and set(SAMPLE_SCHEMA.names) <= set(samples.columns)
    decode = steps[steps.kind != "prefill"]
    assert decode.emitted.sum() == summary["tokens"] == df.response_len.sum()
    assert sorted(samples.sample_id) == sorted(df.sample_id)
    # a second run into the same folder replaces it
    ok(rlsched("generate", "--prompts", str(prompts), "--policy", "off", *FAST, "--out", str(out), cwd=tmp_path))
    assert read_trace(out / "traces", "steps").k.max() == 0


def test_profile_then_goodput_on_the_measured_costs(pair, tmp_path):
    prof = tmp_path / "prof"
    proc = ok(
        rlsched(
            "profile",
            "--batch-sizes",
            "1,4",
            "--k-max",
            "2",
            "--contexts",
            "16",
            "--repeats",
            "1",
            "--drafter",
            "builtin",
            "--drafter",
            "ngram",
            "--statistic",
            "min",
            "--out",
            str(prof),
            cwd=tmp_path,
        )
    )
    assert "verify ms" in proc.stdout and json.loads((prof / "profile.json").read_text())["statistic"] == "min"
    rec = read_trace(prof / "traces", "steps")
    assert set(rec.kind) == {"prefill", "feed", "verify", "draft"} and set(rec.drafter) >= {"model", "ngram"}
    assert set(rec[rec.kind == "feed"].drafter) == {"model"}  # a model drafter's catch-up; n-gram has none
    feed = rec[rec.kind == "feed"]
    assert len(feed) == len(rec[rec.kind == "prefill"]) and (feed.step_ms > 0).all()
    assert len(rec[rec.kind == "verify"]) == 2 * 3 and (rec.verify_ms[rec.kind == "verify"] > 0).all()
    out = tmp_path / "gen"
    summary = json.loads(
        ok(
            rlsched(
                "generate",
                "--policy",
                "goodput",
                "--cost-model",
                str(prof),
                *FAST,
                "--out",
                str(out),
                "--json",
                cwd=tmp_path,
            )
        ).stdout
    )
    assert summary["policy"] == "goodput" and summary["samples"] == 64
    # twostate solves its threshold and k over the same measured costs
    summary = json.loads(
        ok(
            rlsched(
                "generate",
                "--policy",
                "twostate",
                "--cost-model",
                str(prof),
                *FAST,
                "--out",
                str(tmp_path / "ts"),
                "--json",
                cwd=tmp_path,
            )
        ).stdout
    )
    assert summary["policy"] == "twostate" and summary["samples"] == 64


@pytest.mark.parametrize("b, ctx", [(1, 64), (2, 64), (7, 33), (64, 192)])
def test_profiled_rows_differ_in_length_as_the_engines_do(b, ctx):
    from rlsched.executor.profiler import profile_cache_len, ragged_lengths

    lens = ragged_lengths(b, ctx)
    assert len(lens) == b and sum(lens) == b * ctx  # the record's ctx_tokens stays b * ctx
    assert max(lens) + 2 * 6 < profile_cache_len([ctx], 6)
    if b == 1:
        assert lens == [ctx]
    else:
        assert min(lens) == round(ctx / 2) and abs(max(lens) - 1.5 * ctx) <= 1 and len(set(lens)) > 1


def test_a_profile_point_is_priced_from_all_its_runs_over_the_passes(pair):
    import torch

    from rlsched.executor.decode.drafters import ModelDrafter, NgramDrafter
    from rlsched.executor.decode.sampling import SamplingParams
    from rlsched.executor.model.loading import load_model
    from rlsched.executor.profiler import profile, profile_cache_len, typical_ms

    target, drafter = load_model(pair.target).model, load_model(pair.drafter).model
    sampling = SamplingParams(temperature=1.0)
    drafters = {"model": ModelDrafter(drafter, sampling, 2, profile_cache_len([8], 1)), "ngram": NgramDrafter()}
    torch.manual_seed(0)
    records = profile(
        target,
        drafters,
        batch_sizes=(1, 2),
        k_max=1,
        contexts=(8,),
        repeats=4,
        passes=2,
        sampling=sampling,
        statistic=len,
    )  # the price = how many runs it saw
    runs = {(r["kind"], r["k"]): r for r in records}
    # verify and draft: 2 runs a pass x 2 passes; prefill and the drafter's feed half as many
    assert all(r["step_ms"] == 4 for r in records if r["kind"] in ("verify", "draft"))
    assert all(r["step_ms"] == 2 for r in records if r["kind"] in ("prefill", "feed"))
    assert runs[("verify", 1)]["verify_ms"] == 4 and runs[("draft", 1)]["draft_ms"] == 4
    assert all("runs_ms" not in r for r in records)  # the runs are not written out
    assert typical_ms([9.0, 1.0, 2.0]) == 2.0  # the median: what a run typically pays, not the fastest


def test_generate_with_ngram_and_auto_profile(pair, tmp_path):
    out = tmp_path / "gen"
    summary = json.loads(
        ok(
            rlsched(
                "generate",
                "--drafter",
                "ngram",
                "--policy",
                "goodput",
                *FAST,
                "--max-batch",
                "4",
                "--out",
                str(out),
                "--json",
                cwd=tmp_path,
            )
        ).stdout
    )
    assert summary["drafter"] == "ngram" and summary["tokens"] > 0


def test_generate_with_the_suffix_drafter_on_revisited_prompts(pair, tmp_path):
    """Many samples of one prompt: the suffix drafter drafts from the earlier ones and gets
    tokens accepted."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "repeat: abcabc ="}) + "\n")
    out = tmp_path / "gen"
    summary = json.loads(
        ok(
            rlsched(
                "generate",
                "--drafter",
                "suffix",
                "--policy",
                "static:3",
                "--prompts",
                str(prompts),
                "--n",
                "12",
                "--max-tokens",
                "24",
                "--max-batch",
                "4",
                "--k-max",
                "3",
                "--out",
                str(out),
                "--json",
                cwd=tmp_path,
            )
        ).stdout
    )
    assert summary["drafter"] == "suffix" and summary["tokens"] > 0
    steps = read_trace(out / "traces", "steps")
    assert steps.accepted.sum() > 0 and steps.drafted.sum() > 0


def test_generate_with_the_eagle_head_and_a_draft_tree(pair, tmp_path):
    from rlsched.executor.decode.eagle_builtin import builtin_head

    builtin_head()  # built once here (about a minute on first use), not inside the timed command
    out = tmp_path / "gen"
    summary = json.loads(
        ok(
            rlsched(
                "generate",
                "--drafter",
                "eagle",
                "--policy",
                "static:3",
                *FAST,
                "--out",
                str(out),
                "--json",
                cwd=tmp_path,
            )
        ).stdout
    )
    assert summary["drafter"] == "eagle" and summary["accepted"] > 0
    tree = json.loads(
        ok(
            rlsched(
                "generate",
                "--policy",
                "tree:3:2:6",
                *FAST,
                "--k-max",
                "6",
                "--out",
                str(tmp_path / "tree"),
                "--json",
                cwd=tmp_path,
            )
        ).stdout
    )
    assert tree["drafter"] == "model" and tree["mean_accept_len"] > 1.0
    # the head's drafting profiled, then goodput over its chains and trees priced by that profile
    prof = tmp_path / "prof"
    ok(
        rlsched(
            "profile",
            "--drafter",
            "eagle",
            "--batch-sizes",
            "1,4",
            "--k-max",
            "3",
            "--width-max",
            "2",
            "--contexts",
            "16",
            "--repeats",
            "1",
            "--out",
            str(prof),
            cwd=tmp_path,
        )
    )
    rec = read_trace(prof / "traces", "steps")
    drafts = rec[rec.kind == "draft"]
    assert set(drafts.drafter) == {"eagle"} and (drafts.draft_ms > 0).all()
    # chains and trees of width 2, each depth 1..3 at each batch size
    assert sorted(drafts.groupby("width").size().items()) == [(1, 6), (2, 6)]
    assert "feed" not in set(rec.kind)  # the head is handed the target's states: nothing to catch up
    adaptive = json.loads(
        ok(
            rlsched(
                "generate",
                "--drafter",
                "eagle",
                "--policy",
                "goodput",
                "--cost-model",
                str(prof),
                "--width-max",
                "2",
                *FAST,
                "--out",
                str(tmp_path / "adaptive"),
                "--json",
                cwd=tmp_path,
            )
        ).stdout
    )
    assert adaptive["drafter"] == "eagle" and adaptive["samples"] == 64
    proc = rlsched(
        "generate",
        "--model",
        str(pair.target),
        "--drafter",
        "eagle",
        "--policy",
        "static:2",
        "--out",
        str(tmp_path / "bad"),
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "drafter eagle is the built-in target's EAGLE-3 head" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()


def test_kill_minus_nine_keeps_completed_steps_readable(pair, tmp_path):
    out = tmp_path / "gen"
    env = dict(os.environ, COLUMNS="400")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlsched",
            "generate",
            "--policy",
            "static:2",
            "--n",
            "8",
            "--max-tokens",
            "200",
            "--ignore-eos",
            "--max-batch",
            "4",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    journal = out / "traces" / "steps" / "part-000000.jsonl"  # the records of the part being filled
    deadline = time.time() + 1800
    while time.time() < deadline and (not journal.exists() or journal.read_text().count("\n") < 12):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps = read_trace(out / "traces", "steps")
    assert len(steps) >= 8
    decode = steps[steps.kind != "prefill"]
    assert list(decode.step) == list(range(len(decode)))  # no gap, no duplicate
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize(
    "case, args, message",
    [
        ("missing model", ["--model", "{tmp}/nope"], "model folder {tmp}/nope does not exist"),
        ("corrupt model", ["--model", "{tmp}/corrupt"], "is not valid JSON"),
        ("unsupported arch", ["--model", "{tmp}/gpt2"], "field 'model_type' is 'gpt2'"),
        ("drafter vocab", ["--drafter", "{tmp}/othervocab"], "vocabulary of 50 tokens"),
        ("bad prompts json", ["--prompts", "{tmp}/bad.jsonl"], "line 2: not valid JSON"),
        ("prompt field", ["--prompts", "{tmp}/nofield.jsonl"], "line 1: needs a non-empty string field 'prompt'"),
        ("no prompts file", ["--prompts", "{tmp}/absent.jsonl"], "prompts file {tmp}/absent.jsonl does not exist"),
        ("unknown policy", ["--policy", "fastest"], "fastest"),
        ("priced policy spec", ["--policy", "goodput:0"], "refresh interval must be a whole number"),
        (
            "cost model folder",
            ["--policy", "goodput", "--cost-model", "{tmp}/noprof"],
            "--cost-model: {tmp}/noprof is neither a `rlsched profile` folder",
        ),
        ("temperature", ["--temperature", "-1"], "temperature must be >= 0"),
        ("top-p", ["--top-p", "0"], "top_p must lie in (0, 1]"),
        ("n", ["--n", "0"], "--n must be >= 1"),
        ("kv budget", ["--kv-budget", "10"], "exceed the KV cache capacity (10)"),
        ("device", ["--device", "tpu"], "device 'tpu'"),
        ("compile with instances", ["--compile", "--instances", "2"], "--compile runs in this process"),
        ("width max", ["--width-max", "0"], "--width-max must be >= 1"),
        ("trees of a chain drafter", ["--drafter", "ngram", "--width-max", "2"], "the ngram drafter drafts no trees"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(pair, tmp_path, case, args, message):
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "config.json").write_text("{not json")
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    other = tmp_path / "othervocab"
    other.mkdir()
    raw = json.loads((pair.drafter / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**raw, "vocab_size": 50}))
    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(str(pair.drafter / "model.safetensors"))
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][:50].clone()
    save_file(state, str(other / "model.safetensors"))
    del torch
    (tmp_path / "bad.jsonl").write_text('{"prompt": "add 1+2="}\n{"prompt": \n')
    (tmp_path / "nofield.jsonl").write_text('{"text": "add 1+2="}\n')
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    before = snapshot(tmp_path)
    proc = rlsched("generate", *args, "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 2, (case, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert message.replace("{tmp}", str(tmp_path)) in lines[0], lines[0]
    assert snapshot(tmp_path) == before  # nothing written


@pytest.mark.parametrize(
    "drafter, policy, message",
    [
        ("{tmp}/nodrafter", "static:9", "policy 'static:9': K = 9 is above --k-max = 3; lower K or raise --k-max"),
        ("{tmp}/nodrafter", "fastest", "unknown policy 'fastest'"),
        ("off", "static:2", "--drafter is off; give --drafter builtin"),
        ("ngram", "static:2:model", "unknown drafter 'model'; --drafter gives ngram"),
    ],
)
def test_the_policy_is_checked_before_any_model_is_loaded(tmp_path, drafter, policy, message):
    """The model folders do not exist: were they loaded first, that would be the error."""
    before = snapshot(tmp_path)
    drafter = drafter.replace("{tmp}", str(tmp_path))
    proc = rlsched(
        "generate",
        "--model",
        str(tmp_path / "nomodel"),
        "--drafter",
        drafter,
        "--policy",
        policy,
        "--k-max",
        "3",
        "--out",
        str(tmp_path / "out"),
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert message in lines[0] and "does not exist" not in lines[0], lines[0]
    assert snapshot(tmp_path) == before  # nothing written


def test_profile_bad_input(pair, tmp_path):
    proc = rlsched("profile", "--batch-sizes", "1,x", "--out", str(tmp_path / "p"), cwd=tmp_path)
    assert proc.returncode == 2 and "--batch-sizes must be comma-separated" in proc.stderr
    assert not (tmp_path / "p").exists()
    proc = rlsched("profile", "--statistic", "mean", "--out", str(tmp_path / "p"), cwd=tmp_path)
    assert proc.returncode == 2 and "--statistic must be one of median, min" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "p").exists()


def test_a_model_folder_defaults_to_the_ngram_drafter(pair, tmp_path):
    """The built-in drafter only fits the built-in target; another model drafts with n-grams
    unless told otherwise."""
    summary = json.loads(
        ok(
            rlsched(
                "generate",
                "--model",
                str(pair.target),
                "--policy",
                "static:2",
                *FAST,
                "--out",
                str(tmp_path / "g"),
                "--json",
                cwd=tmp_path,
            )
        ).stdout
    )
    assert summary["drafter"] == "ngram" and summary["model"] == str(pair.target)
