"""RL prompt sources: the data order is a pure function of (seed, step); bad files are one-line
UserErrors naming the file and line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from rlsched.errors import UserError
from rlsched.executor.rl.data import Item, builtin_tasks, jsonl_dataset, make_source
from rlsched.tasks.synthetic import TASKS


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# --- built-in tasks -------------------------------------------------------------------------


def test_builtin_same_seed_and_step_same_prompts_across_objects():
    a, b = builtin_tasks(("count", "repeat", "rev"), seed=3), builtin_tasks(("count", "repeat", "rev"), seed=3)
    assert a.batch(7, 16) == b.batch(7, 16)
    assert b.batch(7, 16) == a.batch(7, 16)  # no hidden state: asking again gives the same
    # a resumed run asks for step 7 first; the order of calls does not matter
    fresh = builtin_tasks(("count", "repeat", "rev"), seed=3)
    assert fresh.batch(7, 16) == a.batch(7, 16)


def test_builtin_steps_and_seeds_differ_and_tasks_are_respected():
    src = builtin_tasks(("count", "repeat", "rev"), seed=0)
    batches = [src.batch(s, 8) for s in range(4)]
    prompts = [tuple(i.prompt for i in b) for b in batches]
    assert len(set(prompts)) == 4
    assert builtin_tasks(("count", "repeat", "rev"), seed=1).batch(0, 8) != batches[0]
    items = [i for b in batches for i in b]
    assert all(isinstance(i, Item) and i.task in ("count", "repeat", "rev") for i in items)
    assert all(i.prompt.endswith("=") and i.answer for i in items)
    assert len({i.key for i in items}) == len(items)
    assert src.size is None and bool(src)
    with pytest.raises(TypeError, match="endless"):
        len(src)


def test_builtin_answers_are_the_tasks_answers():
    item = builtin_tasks(("rev",), seed=0).batch(2, 1)[0]
    word = item.prompt.removeprefix("rev ").removesuffix("=")
    assert item.answer == word[::-1] and item.task == "rev"


def test_unknown_task_lists_the_known_ones():
    with pytest.raises(UserError) as e:
        builtin_tasks(("count", "divide"), seed=0)
    msg = str(e.value)
    assert "'divide'" in msg and all(t in msg for t in TASKS) and "\n" not in msg
    with pytest.raises(UserError, match="no built-in task"):
        make_source("builtin:", 0)


def test_make_source_specs(tmp_path):
    everything = make_source("builtin", 0).batch(0, 60)
    assert {i.task for i in everything} == set(TASKS)
    assert {i.task for i in make_source("builtin: add , sort", 0).batch(0, 30)} == {"add", "sort"}
    f = _write(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    assert len(make_source(str(f), 0)) == 2


# --- JSONL datasets -------------------------------------------------------------------------


@pytest.fixture
def seven(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i), "id": f"id{i}"} for i in range(7)]
    return _write(tmp_path / "data.jsonl", rows)


def test_jsonl_epochs_cover_every_item_once(seven):
    src = jsonl_dataset(seven, seed=5)
    assert len(src) == 7
    draws = [i for s in range(7) for i in src.batch(s, 3)]  # 21 draws = 3 epochs, batches cross epochs
    epochs = [draws[e * 7 : (e + 1) * 7] for e in range(3)]
    for epoch in epochs:
        assert Counter(i.key for i in epoch) == Counter(f"id{i}" for i in range(7))
    orders = [[i.key for i in epoch] for epoch in epochs]
    assert len({tuple(o) for o in orders}) == 3  # each epoch is its own permutation
    item = next(i for i in draws if i.key == "id4")
    assert (item.prompt, item.answer, item.task) == ("q4", "4", None)


def test_jsonl_order_is_a_function_of_seed_and_step(seven):
    a = jsonl_dataset(seven, seed=5)
    full = [a.batch(s, 3) for s in range(6)]
    resumed = jsonl_dataset(seven, seed=5)
    assert [resumed.batch(s, 3) for s in (4, 5)] == full[4:]  # resumed at step 4
    assert [resumed.batch(s, 3) for s in range(6)] == full
    other = jsonl_dataset(seven, seed=6)
    assert [other.batch(s, 3) for s in range(6)] != full
    plain = jsonl_dataset(seven, seed=5, shuffle=False)
    assert [i.key for i in plain.batch(2, 3)] == ["id6", "id0", "id1"]  # file order, wrapping


def test_jsonl_batch_larger_than_the_file(seven):
    src = jsonl_dataset(seven, seed=0)
    batch = src.batch(1, 10)  # draws 10..19: the end of epoch 1, most of epoch 2
    assert batch == [src.batch(g, 1)[0] for g in range(10, 20)]  # draw g is the same whatever the size
    assert len({i.key for i in batch[:4]}) == 4 and len({i.key for i in batch[4:]}) == 6
    plain = jsonl_dataset(seven, seed=0, shuffle=False).batch(1, 10)
    assert [i.key for i in plain] == [f"id{i}" for i in (3, 4, 5, 6, 0, 1, 2, 3, 4, 5)]


def test_jsonl_keys_default_to_line_numbers(tmp_path):
    f = _write(tmp_path / "p.jsonl", [{"prompt": "a", "id": 12}, "", {"prompt": "b"}])
    keys = sorted(i.key for i in jsonl_dataset(f, 0, shuffle=False).batch(0, 2))
    assert keys == ["12", "3"]


@pytest.mark.parametrize(
    "rows, line, words",
    [
        (['{"prompt": "a"}', "{not json"], 2, "not valid JSON"),
        ([{"prompt": "a"}, {"answer": "1"}], 2, "'prompt'"),
        ([{"prompt": ""}], 1, "'prompt'"),
        ([{"prompt": "a", "answer": 3}], 1, "'answer' must be a string"),
    ],
)
def test_bad_lines_name_the_file_and_line(tmp_path, rows, line, words):
    f = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(UserError) as e:
        jsonl_dataset(f, 0)
    msg = str(e.value)
    assert str(f) in msg and f"line {line}" in msg and words in msg and "\n" not in msg


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(UserError) as e:
        make_source(str(tmp_path / "nope.jsonl"), 0)
    assert str(tmp_path / "nope.jsonl") in str(e.value) and "does not exist" in str(e.value)
    assert "builtin" in str(e.value)
    f = tmp_path / "empty.jsonl"
    f.write_text("\n\n")
    with pytest.raises(UserError, match="holds no prompts") as e:
        jsonl_dataset(f, 0)
    assert str(f) in str(e.value)


def test_bad_step_or_size_is_a_programming_error(seven):
    with pytest.raises(ValueError):
        jsonl_dataset(seven, 0).batch(-1, 2)
    with pytest.raises(ValueError):
        builtin_tasks(("add",), 0).batch(0, 0)


def test_builtin_source_does_not_import_torch():
    code = (
        "import sys\nfrom rlsched.executor.rl.data import make_source\n"
        "make_source('builtin:add', 0).batch(3, 4)\n"
        "from rlsched.executor.rl.rewards import resolve_reward\n"
        "resolve_reward('math'); resolve_reward('exact_match')\n"
        "assert 'torch' not in sys.modules, 'torch imported'\nprint('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_builtin_fixed_set_is_read_in_epochs():
    src = make_source("builtin:count,repeat@12", 3)
    assert src.size == 12
    first = [i.key for s in range(3) for i in src.batch(s, 4)]  # one epoch: every item once
    assert sorted(first) == sorted(f"set.{i}" for i in range(12))
    assert {i.task for i in src.items} <= {"count", "repeat"}
    again = make_source("builtin:count,repeat@12", 3)
    assert [i.prompt for i in again.batch(5, 4)] == [i.prompt for i in src.batch(5, 4)]
    with pytest.raises(UserError, match="@"):
        make_source("builtin:count@zero", 0)
