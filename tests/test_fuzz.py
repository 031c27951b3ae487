"""Property-based fuzzing of everything a user hands the tool: config files, `--set`s, policy
names, policy files, trace journals and output folders. The contract: every input either works
or raises `UserError` with one non-empty line; any other exception is a failure.

`RLSCHED_FUZZ_EXAMPLES` sets the examples a property (default 120, derandomized, so the
normal suite is reproducible); set, the draws are random and hypothesis prints the seed and a
reproduction blob of a failure (`make fuzz` runs 20,000 a property).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import string
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support import ok, one_line_error, rlsched

from rlsched.config import apply_override, build_config, load_preset_data, preset_names, read_config_file
from rlsched.errors import UserError
from rlsched.policies.registry import ENGINES, FAMILIES, GENERATE, SIMULATOR, parse_policy, run_words
from rlsched.traces.reader import read_trace
from rlsched.traces.schema import SCHEMAS

EXAMPLES = int(os.environ.get("RLSCHED_FUZZ_EXAMPLES", "120"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="RLSCHED_FUZZ_EXAMPLES" not in os.environ,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
FEW = settings(FUZZ, max_examples=max(EXAMPLES // 8, 10))  # properties that draw figures
JOBS = preset_names("jobs")


def holds(fn, *args, **kwargs):
    """fn's result, or None where it refused with a one-line UserError; anything else raises."""
    try:
        return fn(*args, **kwargs)
    except UserError as e:
        lines = str(e).splitlines()
        assert len(lines) == 1 and lines[0].strip(), f"a UserError of {len(lines)} lines: {str(e)!r}"
        return None


@pytest.fixture(scope="module")
def work():
    with tempfile.TemporaryDirectory(prefix="rlsched-fuzz-") as d:
        yield Path(d)


# ----------------------------------------------------------------------------- values

BIG = 2**70
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.integers(-BIG, BIG),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["off", "goodput", "static:4", "h100-sxm", "qwen2.5-7b", "model", "nope", "1e400", ".inf"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8) | st.sampled_from(["name", "k"]), inner)
    ),
    max_leaves=10,
) | st.lists(st.integers(-1, 300), min_size=1, max_size=4)  # a table's cells, trees among them


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


def _at(node, path):
    for key in path:
        node = node[key]
    return node


@st.composite
def mutated(draw, base, edits: int = 3):
    """`base` with 1..edits values replaced, keys deleted or junk added, anywhere in it."""
    data = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, edits))):
        path = draw(st.sampled_from(list(_paths(data))))
        op = draw(st.sampled_from(["set", "delete", "add"]))
        node = _at(data, path)
        if op == "add" and isinstance(node, dict):
            node[draw(st.text(max_size=8))] = draw(values)
        elif op == "add" and isinstance(node, list):
            node.insert(draw(st.integers(0, len(node))), draw(values))
        elif not path:
            continue
        elif op == "delete":
            del _at(data, path[:-1])[path[-1]]
        else:
            _at(data, path[:-1])[path[-1]] = draw(values)
    return data


def dotted(data) -> list[str]:
    return sorted({".".join(map(str, p)) for p in _paths(data) if p})


def yaml_text(data) -> str:
    return yaml.safe_dump(data, allow_unicode=True, sort_keys=False)


def _toml_value(v) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items() if x is not None) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v if x is not None) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v != v:
        return "nan"
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return "inf" if v > 0 else "-inf"
    return json.dumps(v, ensure_ascii=False)


def toml_text(data: dict) -> str:
    """`data` as TOML, one `key = value` a top-level field (TOML has no null: those are left out)."""
    return "".join(f"{json.dumps(str(k))} = {_toml_value(v)}\n" for k, v in data.items() if v is not None)


# YAML scalars and flows as a --set value, or a policy name's parts, are written
yaml_scalars = st.sampled_from(
    [".inf", "-.inf", ".nan", "-1", "0", "1", "1.5", "1e400", str(10**30), "-" + str(10**30), "abc", "", "off", "on"]
    + ["null", "~", "true", "[1, 2]", "{a: 1}", "[", "{", '"x', "!!python/object:os.system", "0x10", "1_000", "é"]
)
set_values = yaml_scalars | st.text(max_size=10) | values.map(lambda v: json.dumps(v, allow_nan=True))


def junk_path(real: list[str]):
    return st.one_of(
        st.sampled_from(real).map(lambda p: p + ".x"),
        st.sampled_from(real).map(lambda p: p + ".0"),
        st.text(alphabet=string.ascii_lowercase + "._0=:", max_size=12),
        st.text(max_size=8),
    )


def assignments(real: list[str]):
    path = st.sampled_from(real) | junk_path(real)
    return st.tuples(path, set_values).map("=".join) | st.text(max_size=16)


# ----------------------------------------------------------------------------- 1. config files


def _run_config_base() -> dict:
    from rlsched.executor.rl.config import build_run_config

    return build_run_config({}).model_dump(mode="json")


def _check_config_file(path: Path) -> None:
    from rlsched.executor.rl.config import load_run_config

    data = holds(read_config_file, path)
    if data is not None:
        holds(build_config, data, source=str(path))
    holds(load_run_config, path)


@FUZZ
@given(body=st.binary(max_size=300), suffix=st.sampled_from([".yaml", ".toml", ".yml", ".json", ""]))
def test_config_file_bytes(work, body, suffix):
    path = work / f"bytes{suffix}"
    path.write_bytes(body)
    _check_config_file(path)


@FUZZ
@given(text=st.text(max_size=200) | values.map(yaml_text), suffix=st.sampled_from([".yaml", ".toml"]))
def test_config_file_text(work, text, suffix):
    path = work / f"text{suffix}"
    path.write_text(text, encoding="utf-8")
    _check_config_file(path)


@FUZZ
@given(data=st.data(), name=st.sampled_from(JOBS), suffix=st.sampled_from([".yaml", ".toml"]))
def test_mutated_preset_as_file(work, data, name, suffix):
    cfg = data.draw(mutated(load_preset_data("jobs", name)))
    path = work / f"preset{suffix}"
    path.write_text(yaml_text(cfg) if suffix == ".yaml" else toml_text(cfg), encoding="utf-8")
    data_back = holds(read_config_file, path)
    if data_back is not None:
        holds(build_config, data_back, source=str(path))


@FUZZ
@given(data=st.data(), suffix=st.sampled_from([".yaml", ".toml"]))
def test_mutated_run_config_as_file(work, data, suffix):
    from rlsched.executor.rl.config import load_run_config

    cfg = data.draw(mutated(_run_config_base()))
    path = work / f"run{suffix}"
    path.write_text(yaml_text(cfg) if suffix == ".yaml" else toml_text(cfg), encoding="utf-8")
    holds(load_run_config, path)


# ----------------------------------------------------------------------------- 2. --set overrides


@FUZZ
@given(data=st.data(), name=st.sampled_from(JOBS))
def test_set_overrides_on_a_preset(data, name):
    base = load_preset_data("jobs", name)
    sets = data.draw(st.lists(assignments(dotted(base)), min_size=1, max_size=3))
    scratch = copy.deepcopy(base)
    for s in sets:
        holds(apply_override, scratch, s)
    holds(build_config, base, sets, source=f"preset '{name}'")


@FUZZ
@given(data=st.data())
def test_set_overrides_on_a_run_config(data):
    from rlsched.executor.rl.config import build_run_config

    base = _run_config_base()
    sets = data.draw(st.lists(assignments(dotted(base)), min_size=1, max_size=3))
    holds(build_run_config, {}, sets)


# ----------------------------------------------------------------------------- 3. policy names

policy_parts = st.one_of(
    st.integers(-3, 40).map(str),
    st.integers(0, 10**40).map(str),
    st.sampled_from(["", "drain", "seq", "p.json", "model", "ngram", "0.1", "nan", "1e400", "-0", " 1", "1 "]),
    st.sampled_from(["²", "٣", "１", "¹²", "𝟙", "\n", "\x00", "\u2028", "x\ny"]),
    st.text(max_size=6),
)
policy_texts = st.one_of(
    st.tuples(st.sampled_from(sorted(FAMILIES)), st.lists(policy_parts, max_size=4)).map(
        lambda t: ":".join([t[0], *t[1]])
    ),
    st.text(max_size=20),
    st.text(max_size=10).map(lambda t: t + ".json"),
)


@FUZZ
@given(text=policy_texts, engine=st.sampled_from(ENGINES), k_max=st.integers(1, 32))
@example(text="static:²", engine="simulator", k_max=8)
@example(text="goodput:" + "1" * 5000, engine="local", k_max=8)
@example(text="tree:999999999999999999:16:999999999999999999", engine="simulator", k_max=8)
@example(text="static:0:x\ny", engine="vllm", k_max=8)
def test_policy_names(text, engine, k_max):
    spec = holds(parse_policy, text, engine)
    if spec is None:
        return
    assert str(spec) == text.strip()
    for words in (SIMULATOR, GENERATE, run_words(engine)):
        holds(spec.check, ("model", "ngram"), k_max, words)
        holds(spec.check, (), k_max, words)


# ----------------------------------------------------------------------------- 4. policy files


_TABLE = {"batch_edges": [1, 2, 4], "accept_edges": [0.0, 0.5, 1.0], "k": [[0, 1, 2], [3, [2, 2, 3], 4]]}


def _policy_files() -> list[dict]:
    """A table of one context bucket, a table over contexts, a two-state chain and tree."""
    head = {"format": "rlsched-policy", "version": 1, "drafter": "model"}
    learned = {"model": "qwen2.5-7b", "hardware": "h100-sxm", "tp": 1, "model_shape": {"hidden": 8, "layers": 2}}
    table = _TABLE
    return [
        {**head, "kind": "table", "params": table, "learned_on": learned},
        {
            **head,
            "kind": "table",
            "params": {**table, "ctx_edges": [0, 512], "k": [[[0, 1, 2], [1, 1, 1]], [[2, 2, 2], [3, 3, 3]]]},
            "realloc": {"policy": "rebalance", "threshold": 8},
            "learned_on": {**learned, "cost_model": {"kind": "fitted", "model_shape": {"hidden": 8}}},
        },
        {**head, "kind": "twostate", "params": {"max_batch_on": 16, "k": 3}},
        {**head, "kind": "twostate", "params": {"max_batch_on": 16, "k": 3, "width": 2, "nodes": 5}},
    ]


def _check_policy_file(path: Path, identity: dict | None) -> None:
    from rlsched.policies.acceptance import AcceptanceEstimator
    from rlsched.policies.draft import PolicyContext
    from rlsched.policies.policyfile import check_model_shape, learned_shape, load_policy_file
    from rlsched.policies.registry import PolicySpec, make_draft_policy
    from rlsched.policies.types import EngineState

    pf = holds(load_policy_file, path, identity)
    if pf is None:
        return
    holds(learned_shape, pf)
    holds(check_model_shape, pf, path, {"hidden": 8, "layers": 2}, "the model")
    ctx = PolicyContext(cost=None, drafters=("model", "ngram"), identity=identity or {}, width_max=4)
    policy = holds(make_draft_policy, PolicySpec(str(path), None, file=str(path)), ctx)
    if policy is not None:  # it chooses for any batch, context and acceptance
        for batch, ctx_len in ((1, 0), (3, 700), (300, 10**6)):
            est = AcceptanceEstimator(["model", "ngram"], prior_mean=0.6)
            ids = np.arange(batch)
            est.begin_rollout(batch, ids)
            ctx_lens = np.full(batch, ctx_len)
            policy.choose(EngineState(0, 0, 0.0, ids, ctx_lens, int(ctx_lens.sum()), 0, 10**6, est))


def _json(base: dict, **fields) -> bytes:
    return json.dumps({**base, **fields}).encode()


identities = st.none() | st.fixed_dictionaries(
    {"model": st.sampled_from(["qwen2.5-7b", "other"]), "hardware": st.just("h100-sxm"), "tp": st.integers(1, 2)},
    optional={"drafters": st.lists(st.sampled_from(["model", "ngram", "x"]), max_size=2)},
)


@FUZZ
@given(data=st.data(), base=st.sampled_from(_policy_files()), identity=identities)
def test_mutated_policy_files(work, data, base, identity):
    path = work / "policy.json"
    path.write_text(json.dumps(data.draw(mutated(base)), allow_nan=True, ensure_ascii=False), encoding="utf-8")
    _check_policy_file(path, identity)


@FUZZ
@given(body=st.binary(max_size=200) | st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n), identity=identities)
@example(body=b"[" * 5000 + b"]" * 5000, identity=None)
@example(body=_json(_policy_files()[2], params={"max_batch_on": 4, "k": 3, "nodes": 5}), identity=None)
@example(body=_json(_policy_files()[0], params={**_TABLE, "k": [[0, 1, [3, 2, 99]], [1, 1, 1]]}), identity=None)
@example(body=_json(_policy_files()[0], drafter="a\nb", **{"\r": 1}), identity={"drafters": ["x"]})
def test_policy_file_bytes(work, body, identity):
    path = work / "bytes.json"
    path.write_bytes(body)
    _check_policy_file(path, identity)


VLLM_TABLE = {"num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 16, 2], [17, 64, 0]]}


@FUZZ
@given(
    data=st.data(),
    base=st.sampled_from([VLLM_TABLE, VLLM_TABLE["num_speculative_tokens_per_batch_size"], *_policy_files()]),
    raw=st.none() | st.binary(max_size=100),
    have=st.sampled_from(["model", "eagle", "ngram", "off"]),
)
@example(data=None, base=VLLM_TABLE, raw=b"[" * 5000, have="model")
def test_vllm_table_files(work, data, base, raw, have):
    from rlsched.policies.registry import PolicySpec
    from rlsched.policies.vllm_plan import speculative_plan

    path = work / "vllm.json"
    body = raw if raw is not None else json.dumps(data.draw(mutated(base)), allow_nan=True).encode()
    path.write_bytes(body)
    spec = PolicySpec(str(path), None, file=str(path))
    holds(speculative_plan, spec, have, k_max=4, max_batch=64)


# ----------------------------------------------------------------------------- 5. trace journals


def _column(t):
    import pyarrow as pa

    if pa.types.is_integer(t):
        return st.integers(-(2 ** (t.bit_width - 1)), 2 ** (t.bit_width - 1) - 1)
    if pa.types.is_floating(t):
        return st.floats(allow_nan=False, allow_infinity=False)
    return st.sampled_from(["decode", "prefill", "verify", "draft", "model", "off"]) | st.text(max_size=6)


def records(kind: str):
    schema = SCHEMAS[kind]
    return st.fixed_dictionaries({n: _column(t) for n, t in zip(schema.names, schema.types)})


@st.composite
def journal(draw, kind: str) -> bytes:
    """Lines of valid records, then lines dropped, cut, garbled, retyped or missing columns."""
    rows = draw(st.lists(records(kind), max_size=6))
    lines = [json.dumps(r, allow_nan=True) for r in rows]
    for _ in range(draw(st.integers(0, 3))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["drop", "cut", "garbage", "retype", "unkey", "extra"]))
        try:
            row = json.loads(lines[i])
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict) and op in ("retype", "unkey", "extra"):
            continue
        if op == "drop":
            del lines[i]
        elif op == "cut":
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
        elif op == "garbage":
            lines[i] = draw(st.binary(min_size=1, max_size=20)).decode("latin-1")
        elif op in ("retype", "unkey"):
            col = draw(st.sampled_from(sorted(row)))
            row.pop(col) if op == "unkey" else row.update({col: draw(values)})
            lines[i] = json.dumps(row, allow_nan=True)
        else:
            lines[i] = json.dumps({**row, draw(st.text(max_size=6)): draw(values)}, allow_nan=True)
    tail = draw(st.sampled_from(["\n", "", "\n\n"]))
    return ("\n".join(lines) + tail).encode("utf-8", "surrogateescape") + draw(st.sampled_from([b"", b"\xff\xfe"]))


@FUZZ
@given(data=st.data(), kind=st.sampled_from(sorted(SCHEMAS)))
def test_trace_journals(work, data, kind):
    folder = work / "journal" / kind
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for i in range(data.draw(st.integers(1, 2))):
        (folder / f"part-{i:06d}.jsonl").write_bytes(data.draw(journal(kind)))
    holds(read_trace, folder, kind)
    holds(read_trace, folder.parent, kind)


# ----------------------------------------------------------------------------- 6. output folders

TINY_RUN = """
steps: 2
checkpoint_every: 2
rollout: {prompts_per_step: 2, group_size: 2, max_tokens: 8, max_batch: 4, k_max: 2}
algorithm: {minibatches: 1}
drafter_update: {every: 0}
"""
SMALL = ["--set", "rl.steps=1", "--set", "workload.prompts=8"]


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A real `rlsched run` folder: 2 tiny RL steps on the built-in pair."""
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("fuzz-run")
    (root / "run.yaml").write_text(TINY_RUN)
    ok(rlsched("run", "--config", "run.yaml", "--policy", "static:2", "--out", "run", cwd=root, timeout=600))
    return root / "run"


@pytest.fixture(scope="module")
def sim_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-sim")
    ok(rlsched("simulate", *SMALL, "--out", "sim", cwd=root, timeout=600))
    return root / "sim"


@st.composite
def damaged(draw, path: Path) -> bytes:
    """New bytes for one file of a folder: its own mutated (YAML, JSON, a Parquet part as a
    journal of its records), cut short, or garbage."""
    body = path.read_bytes()
    how = draw(st.sampled_from(["mutate", "cut", "garbage"]))
    if how == "cut":
        return body[: draw(st.integers(0, len(body)))]
    if how == "garbage":
        return draw(st.binary(max_size=200))
    if path.suffix == ".yaml":
        return yaml_text(draw(mutated(yaml.safe_load(body)))).encode()
    if path.suffix == ".json":
        return json.dumps(draw(mutated(json.loads(body))), allow_nan=True).encode()
    rows = pq.read_table(path).to_pylist()
    return "\n".join(json.dumps(r, allow_nan=True) for r in draw(mutated(rows)) if isinstance(r, dict)).encode()


def _damaged_copy(data, src: Path, work: Path) -> Path:
    dst = work / "folder"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoint.pt", "plots"))
    files = sorted(
        p for p in dst.rglob("*") if p.suffix in (".yaml", ".json", ".parquet") and "rollouts" not in p.parts
    )
    target = data.draw(st.sampled_from(files))
    body = data.draw(damaged(target))
    if target.suffix == ".parquet" and "traces" in target.parts and data.draw(st.booleans()):
        target.unlink()  # a trace part a killed writer left as its journal
        target = target.with_suffix(".jsonl")
    target.write_bytes(body)
    return dst


def _figures(folder: Path) -> None:
    import matplotlib.pyplot as plt

    from rlsched.analysis.folder import figures_for, load_folder
    from rlsched.analysis.report import number_rows

    d = holds(load_folder, folder)
    if d is not None:
        holds(number_rows, d)
        holds(figures_for, d)
    plt.close("all")


@FEW
@given(data=st.data())
def test_damaged_run_folder(run_folder, work, data):
    from rlsched.analysis.replay import read_run

    folder = _damaged_copy(data, run_folder, work)
    holds(read_run, folder)
    _figures(folder)


@settings(FUZZ, max_examples=max(8, EXAMPLES // 50))  # a second a replay
@given(data=st.data())
def test_replay_of_a_run_with_a_damaged_config(run_folder, work, data):
    from rlsched.analysis.replay import replay_run

    folder = work / "replayed"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(run_folder, folder, ignore=shutil.ignore_patterns("checkpoint.pt", "plots", "rollouts"))
    (folder / "config.yaml").write_bytes(data.draw(damaged(folder / "config.yaml")))
    holds(replay_run, folder)


@FEW
@given(data=st.data())
def test_damaged_simulate_folder(sim_folder, work, data):
    _figures(_damaged_copy(data, sim_folder, work))


# ----------------------------------------------------------------------------- the CLI

CLI_PATHS = [p for p in dotted(load_preset_data("jobs", "default")) if p not in ("rl.steps", "workload.prompts")]
CLI_VALUES = st.sampled_from(
    [".inf", "-.inf", ".nan", "-1", "0", "1.5", "abc", "", "off", "null", "[1, 2]", "{a: 1}", "true", "[", "é"]
)


def passable(arg: str) -> bool:
    """Whether the operating system can hand ``arg`` to a program: no NUL, encodable."""
    try:
        return b"\0" not in os.fsencode(arg)
    except UnicodeEncodeError:
        return False


CLI_SETS = st.tuples(st.sampled_from(CLI_PATHS) | junk_path(CLI_PATHS), CLI_VALUES).map("=".join).filter(passable)


@settings(FUZZ, max_examples=max(10, min(EXAMPLES // 100, 200)))  # seconds a run
@given(st.lists(CLI_SETS, max_size=2))
def test_simulate_with_generated_sets(work, sets):
    args = [a for s in sets for a in ("--set", s)]
    proc = rlsched("simulate", *args, *SMALL, "--json", "--out", str(work / "sim-out"), cwd=work, timeout=300)
    shutil.rmtree(work / "sim-out", ignore_errors=True)
    if proc.returncode == 0:
        assert isinstance(json.loads(proc.stdout), dict)
    else:
        one_line_error(proc)
