"""Hostile files given to rlsched's readers: trace journals (a torn or garbage line), Parquet
traces of the wrong shape, run folders (a garbage config.yaml, no samples), checkpoints and
vLLM metric dumps. Each ends as a valid result or as one line naming the file (and the line)
with exit 2, never a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from support import ok, one_line_error, rlsched, run_then_kill, snapshot

from rlsched.errors import UserError
from rlsched.traces.reader import read_trace
from rlsched.traces.schema import RL_STEP_SCHEMA
from rlsched.traces.writer import TraceWriter

TORN = '{"rl_step": 9, "generation_s": 0.12, "infer'  # a record cut short by a kill -9

RUN = """
steps: {steps}
policy: static:2
checkpoint_every: 1
rollout: {{prompts_per_step: 2, group_size: 2, max_tokens: 8, max_batch: 4, k_max: 2}}
algorithm: {{minibatches: 1}}
drafter_update: {{every: 0}}
"""


def _record(s: int) -> dict:
    return {f.name: s if f.name == "rl_step" else 7 if pa.types.is_integer(f.type) else 0.5 for f in RL_STEP_SCHEMA}


def _journal(root: Path, lines: list[bytes] | None = None, records: int = 3) -> Path:
    """A TraceWriter's journal of `records` rl_steps records, as a killed writer leaves it (the
    part never written), then `lines` appended as they are."""
    w = TraceWriter(root, "rl_steps", flush_every=100, journal=True)
    for s in range(records):
        w.append(_record(s))
    assert w._journal is not None
    w._journal.close()  # the process is gone: its journal stays, its Parquet part never came
    path = root / "rl_steps" / "part-000000.jsonl"
    with open(path, "ab") as f:
        f.write(b"\n".join(lines or []))
    return path


def _refused(call, *names: str) -> str:
    with pytest.raises(UserError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for name in names:
        assert name in msg, f"{name!r} not in {msg!r}"
    return msg


# ----------------------------------------------------------------------------- journals


@pytest.mark.parametrize(
    "tail, line",
    [(TORN.encode(), 4), (b"\xff\xfe\x00\x9c binary", 4), (b"[1, 2]\n", 4), (b"   \n{not json\n\n", 5)],
    ids=["torn", "not-utf8", "not-an-object", "garbage-then-blank-lines"],
)
def test_a_torn_or_garbage_last_line_is_dropped_with_one_warning(tmp_path, capsys, tail, line):
    path = _journal(tmp_path, [tail])
    df = read_trace(tmp_path, "rl_steps")
    assert df["rl_step"].tolist() == [0, 1, 2]  # the complete records, the one in flight dropped
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and str(path) in err[0] and f"line {line}" in err[0] and "dropped" in err[0], err
    read_trace(tmp_path, "rl_steps")  # read again (a command reads a trace more than once): said once
    assert not capsys.readouterr().err


@pytest.mark.parametrize(
    "garbage, why",
    [
        (b"\xff\xfe\x00\x9c binary", "not UTF-8"),
        (b"{not json", "not JSON"),
        (b"[1, 2]", "not an object"),
        (b"42", "not an object"),
        (TORN.encode(), "not JSON"),  # a torn line followed by more records is not the writer's
    ],
)
def test_a_garbage_middle_line_is_refused_with_the_file_and_line(tmp_path, garbage, why):
    path = _journal(tmp_path, [garbage, json.dumps(_record(4)).encode(), b""], records=2)
    _refused(lambda: read_trace(tmp_path, "rl_steps"), str(path), "line 3", why)


def test_a_record_lacking_columns_names_the_file_line_and_columns(tmp_path):
    short = {k: v for k, v in _record(3).items() if k not in ("generation_s", "total_s")}
    path = _journal(tmp_path, [json.dumps(short).encode(), json.dumps(_record(4)).encode(), b""])
    _refused(lambda: read_trace(tmp_path, "rl_steps"), str(path), "line 4", "generation_s, total_s")


def test_a_record_of_the_wrong_type_names_the_file_and_column(tmp_path):
    path = _journal(tmp_path, [json.dumps({**_record(3), "prompt_tokens": "many"}).encode(), b""])
    _refused(lambda: read_trace(tmp_path, "rl_steps"), str(path), "prompt_tokens")


def test_a_journal_that_is_a_folder_is_refused(tmp_path):
    (tmp_path / "rl_steps" / "part-000000.jsonl").mkdir(parents=True)
    _refused(lambda: read_trace(tmp_path, "rl_steps"), "part-000000.jsonl", "cannot be read")


# ----------------------------------------------------------------------------- Parquet parts


def test_parquet_parts_of_the_wrong_shape_name_the_file(tmp_path):
    from rlsched.traces.writer import to_table

    good = to_table("rl_steps", pd.DataFrame([_record(0), _record(1)]))
    cases = {
        "lacks": (good.drop(["total_s"]), ["lacks columns total_s"]),
        "type": (
            good.set_column(good.schema.get_field_index("total_s"), "total_s", pa.array(["x", "y"])),
            ["column total_s", "string"],
        ),
        "meta": (good.replace_schema_metadata({b"rlsched.trace": b"\xff not json"}), ["metadata"]),
        "kind": (good.replace_schema_metadata({b"rlsched.trace": b'{"kind": "steps", "version": 1}'}), ["'steps'"]),
    }
    for name, (table, says) in cases.items():
        folder = tmp_path / name / "rl_steps"
        folder.mkdir(parents=True)
        pq.write_table(table, folder / "part-000000.parquet")
        _refused(lambda f=folder: read_trace(f, "rl_steps"), str(folder / "part-000000.parquet"), *says)


def test_parts_disagreeing_on_an_extra_columns_type_name_the_folder(tmp_path):
    from rlsched.traces.writer import to_table, write_table

    folder = tmp_path / "rl_steps"
    folder.mkdir()
    write_table(folder / "part-000000.parquet", to_table("rl_steps", pd.DataFrame([{**_record(0), "note": 1}])))
    write_table(folder / "part-000001.parquet", to_table("rl_steps", pd.DataFrame([{**_record(1), "note": "x"}])))
    _refused(lambda: read_trace(folder, "rl_steps"), str(folder), "disagree")
    # parts whose extra column is whole in one and fractional in the other are one float column
    write_table(folder / "part-000001.parquet", to_table("rl_steps", pd.DataFrame([{**_record(1), "note": 0.5}])))
    assert read_trace(folder, "rl_steps")["note"].tolist() == [1.0, 0.5]


# ----------------------------------------------------------------------------- resuming (in process)


def test_rewinding_drops_a_torn_tail_and_refuses_a_garbage_line_before_changing_anything(tmp_path, capsys):
    pytest.importorskip("torch")
    from rlsched.executor.rl.checkpoint import truncate_traces

    torn = tmp_path / "torn"
    _journal(torn, [TORN.encode()], records=4)
    truncate_traces(torn, 2)
    assert read_trace(torn, "rl_steps")["rl_step"].tolist() == [0, 1]
    assert "dropped" in capsys.readouterr().err and not list((torn / "rl_steps").glob("*.jsonl"))

    bad = tmp_path / "bad"
    journal = _journal(bad, [b"\x00garbage", json.dumps(_record(9)).encode(), b""])
    (bad / "steps").mkdir()  # a kind rewound before rl_steps: untouched too
    (bad / "steps" / "part-000000.jsonl").write_text("")
    before = {p: p.read_bytes() for p in bad.rglob("*") if p.is_file()}
    _refused(lambda: truncate_traces(bad, 1), str(journal), "line 4")
    assert {p: p.read_bytes() for p in bad.rglob("*") if p.is_file()} == before


# ----------------------------------------------------------------------------- vLLM metric dumps

FIX_JSON = Path(__file__).parent / "data" / "vllm_metrics.json"
FIX_PROM = Path(__file__).parent / "data" / "vllm_metrics.prom"


def _snapshot_edit(doc: dict, how: str) -> dict:
    snaps = doc["snapshots"]
    last = snaps[-1]
    if how == "huge-counter":
        metric = next(m for m in last["metrics"] if m.get("type") == "counter")
        metric["value"] = 10**400
    elif how == "drafter-not-a-name":
        for s in snaps:
            s["drafter"] = ["model"]
    elif how == "batch-not-a-number":
        for s in snaps:
            s["batch"] = [4]
    elif how == "k-past-the-traces-range":
        for s in snaps:
            s["k"] = 40000
    return doc


@pytest.mark.parametrize(
    "how", ["huge-counter", "drafter-not-a-name", "batch-not-a-number", "k-past-the-traces-range", "infinite-counter"]
)
def test_vllm_dumps_with_garbage_values_are_one_line(tmp_path, how):
    from rlsched.traces.vllm_metrics import import_vllm

    if how == "infinite-counter":
        src = tmp_path / "m.prom"
        lines = FIX_PROM.read_text().splitlines()
        i = max(i for i, line in enumerate(lines) if line.startswith("vllm:generation_tokens_total"))
        lines[i] = lines[i].rsplit(" ", 1)[0] + " +Inf"
        src.write_text("\n".join(lines) + "\n")
    else:
        src = tmp_path / "m.json"
        src.write_text(json.dumps(_snapshot_edit(json.loads(FIX_JSON.read_text()), how)))
    _refused(lambda: import_vllm(src, tmp_path / "out"), str(src))
    assert not (tmp_path / "out").exists()


def test_a_vllm_snapshot_time_past_float_range_still_imports(tmp_path):
    from rlsched.traces.vllm_metrics import import_vllm

    doc = json.loads(FIX_JSON.read_text())
    for s in doc["snapshots"]:
        s["time_s"] = 10**400  # not a time: the snapshot's index stands in
    src = tmp_path / "m.json"
    src.write_text(json.dumps(doc))
    assert import_vllm(src, tmp_path / "out")["records"] > 0


# ----------------------------------------------------------------------------- through the CLI, on a real run

pytest_e2e = pytest.mark.e2e  # a real `rlsched run` (seconds) and the CLI in subprocesses


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished two-step `rlsched run` folder (the built-in pair: seconds)."""
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("hostile")
    (root / "run.yaml").write_text(RUN.format(steps=2))
    ok(rlsched("run", "--config", str(root / "run.yaml"), "--out", str(root / "run"), cwd=root, timeout=900))
    return root / "run"


def _copy(run: Path, dest: Path, journals: bool = False) -> Path:
    """A copy of the run; with `journals`, as a run killed before writing its parts leaves it:
    each trace kind a journal, no summary."""
    shutil.copytree(run, dest)
    if journals:
        (dest / "summary.json").unlink()
        for part in (dest / "traces").glob("*/part-*.parquet"):
            rows = pd.read_parquet(part).to_dict("records")
            lines = (json.dumps(r, default=lambda v: v.tolist()) + "\n" for r in rows)  # (list columns: arrays)
            part.with_suffix(".jsonl").write_text("".join(lines))
            part.unlink()
    return dest


def _command(name: str, folder: Path, tmp: Path) -> list[str]:
    outs = {"fit": ["--out", str(tmp / "cost.json")], "plot": ["--out", str(tmp / "figs")]}
    outs["report"] = ["--out", str(tmp / "report.html")]
    return [name, str(folder), *outs.get(name, [])]


COMMANDS = ["fit", "replay", "plot", "report"]


@pytest_e2e
@pytest.mark.parametrize("command", COMMANDS)
def test_readers_of_a_killed_runs_torn_journals_warn_and_go_on(run, tmp_path, command):
    folder = _copy(run, tmp_path / "killed", journals=True)
    journal = folder / "traces" / "steps" / "part-000000.jsonl"
    with open(journal, "a") as f:
        f.write('{"rl_step": 1, "instance": 0, "st')
    proc = ok(rlsched(*_command(command, folder, tmp_path), cwd=tmp_path))
    warned = [line for line in proc.stderr.splitlines() if str(journal) in line]
    assert len(warned) == 1 and "dropped" in warned[0], proc.stderr


@pytest_e2e
@pytest.mark.parametrize("command", COMMANDS)
def test_readers_refuse_a_journal_with_a_garbage_middle_line(run, tmp_path, command):
    folder = _copy(run, tmp_path / "killed", journals=True)
    journal = folder / "traces" / "steps" / "part-000000.jsonl"
    lines = journal.read_bytes().split(b"\n")
    lines[2] = b"\x00\xff garbage"
    journal.write_bytes(b"\n".join(lines))
    before = snapshot(tmp_path)
    one_line_error(rlsched(*_command(command, folder, tmp_path), cwd=tmp_path), str(journal), "line 3")
    assert snapshot(tmp_path) == before


@pytest_e2e
@pytest.mark.parametrize("command", COMMANDS)
def test_readers_refuse_a_parquet_part_lacking_columns(run, tmp_path, command):
    folder = _copy(run, tmp_path / "run")
    part = folder / "traces" / "steps" / "part-000000.parquet"
    pq.write_table(pq.read_table(part).drop(["verify_ms", "ctx_tokens"]), part)
    one_line_error(rlsched(*_command(command, folder, tmp_path), cwd=tmp_path), str(part), "verify_ms, ctx_tokens")


@pytest_e2e
@pytest.mark.parametrize(
    "command, damage, says",
    [
        ("replay", "binary", "not valid YAML"),
        ("plot", "binary", "not valid YAML"),
        ("replay", "list", "config"),
        ("report", "list", "config"),
        ("replay", "rollout.max_batch: many", "rollout.max_batch"),
        ("report", "algorithm: grpo", "algorithm"),
    ],
)
def test_a_garbage_config_yaml_is_one_line_naming_it(run, tmp_path, command, damage, says):
    folder = _copy(run, tmp_path / "run")
    config = folder / "config.yaml"
    if damage == "binary":
        config.write_bytes(b"\x80\x81\xff\x00 not yaml")
    elif damage == "list":
        config.write_text("- 1\n- 2\n")
    else:  # one field replaced
        key, value = damage.split(": ", 1)
        cfg = yaml.safe_load(config.read_text())
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        node[leaf] = yaml.safe_load(value)
        config.write_text(yaml.safe_dump(cfg))
    one_line_error(rlsched(*_command(command, folder, tmp_path), cwd=tmp_path), str(config), says)


@pytest_e2e
def test_replay_of_a_run_without_its_samples_names_the_missing_folder(run, tmp_path):
    folder = _copy(run, tmp_path / "run")
    shutil.rmtree(folder / "traces" / "samples")
    one_line_error(rlsched("replay", str(folder), cwd=tmp_path), str(folder / "traces" / "samples"), "missing")


@pytest_e2e
@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "not-a-state"])
def test_resume_refuses_a_damaged_checkpoint_naming_it(run, tmp_path, damage):
    folder = _copy(run, tmp_path / "run", journals=True)
    ck = folder / "checkpoint.pt"
    if damage == "garbage":
        ck.write_text("garbage\n")
    elif damage == "truncated":
        ck.write_bytes(ck.read_bytes()[:4096])
    elif damage == "empty":
        ck.write_bytes(b"")
    else:
        import torch

        torch.save([1, 2, 3], ck)
    before = snapshot(folder)
    one_line_error(rlsched("run", "--out", str(folder), "--resume", cwd=tmp_path), str(ck), "delete it")
    assert snapshot(folder) == before
    if damage == "garbage":  # as the line says: without it, --resume runs again from step 0
        ck.unlink()
        ok(rlsched("run", "--out", str(folder), "--resume", cwd=tmp_path, timeout=900))
        assert read_trace(folder / "traces", "rl_steps")["rl_step"].tolist() == [0, 1]


@pytest_e2e
def test_resume_refuses_a_journal_with_a_garbage_middle_line(run, tmp_path):
    folder = _copy(run, tmp_path / "run", journals=True)
    journal = folder / "traces" / "rl_steps" / "part-000000.jsonl"
    journal.write_text("not a record\n" + journal.read_text())
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    one_line_error(rlsched("run", "--out", str(folder), "--resume", cwd=tmp_path), str(journal), "line 1")
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


@pytest_e2e
def test_a_killed_run_whose_journals_end_in_a_torn_line_resumes(tmp_path):
    """kill -9 mid-run, each journal then cut mid-record (a write the kill interrupted): the
    resumed run drops the torn records, says so, and ends with every step once."""
    pytest.importorskip("torch")
    config = tmp_path / "run.yaml"
    config.write_text(RUN.format(steps=5))
    out = tmp_path / "cut"
    run_then_kill(config, out, tmp_path, steps_recorded=1, timeout=900, checkpoint=True)
    assert not (out / "summary.json").exists()
    # the journals of parts never written (a part written just before the kill leaves its journal behind)
    journals = [j for j in sorted((out / "traces").glob("*/part-*.jsonl")) if not j.with_suffix(".parquet").exists()]
    assert any(j.parent.name == "rl_steps" for j in journals), journals
    for j in journals:
        with open(j, "a") as f:
            f.write('{"rl_step": 4, "sample_id": 1')
    proc = ok(rlsched("run", "--out", str(out), "--resume", cwd=tmp_path, timeout=900))
    for j in journals:
        warned = [line for line in proc.stderr.splitlines() if str(j) in line]
        assert len(warned) == 1 and "dropped" in warned[0], proc.stderr
    assert sorted(read_trace(out / "traces", "rl_steps")["rl_step"]) == [0, 1, 2, 3, 4]
    assert sorted(read_trace(out / "traces", "samples")["sample_id"]) == list(range(5 * 4))
    assert not list((out / "traces").glob("*/*.jsonl")) and (out / "summary.json").is_file()
