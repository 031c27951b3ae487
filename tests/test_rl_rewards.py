"""RL rewards: built-in exact_match and math, user functions (module or file, per sample or
batched; a failing sample fails alone), and reward models checked against transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlsched.errors import UserError
from rlsched.executor.rl.rewards import RewardInput, resolve_reward


def _items(*triples, prompt="p"):
    return [
        RewardInput(prompt, response, answer, prompt_id=i // 2, sample_id=i)
        for i, (response, answer) in enumerate(triples)
    ]


# --- exact_match and math -------------------------------------------------------------------


def test_exact_match_and_missing_answer():
    fn = resolve_reward("exact_match")
    out = fn.score(_items((" 1399 ", "1399"), ("1398", "1399"), ("olleh", None)))
    assert fn.name == "exact_match"
    assert out.rewards.dtype == np.float64 and out.rewards[:2].tolist() == [1.0, 0.0]
    assert np.isnan(out.rewards[2]) and out.failed.tolist() == [False, False, True]
    assert len(out.errors) == 1 and out.errors[0].startswith("sample 2 (prompt 1):")
    assert '"answer"' in out.errors[0] and "\n" not in out.errors[0]


@pytest.mark.parametrize(
    "response, answer, want",
    [
        (r"so the total is \boxed{42}.", "42", 1.0),
        (r"first \boxed{7}, on reflection \boxed{8}", "8", 1.0),  # the last box
        (r"\boxed{\frac{3}{4}}", "0.75", 1.0),
        (r"\boxed{x = 5}", "5", 1.0),
        (r"\boxed{\text{Paris}}", "paris", 1.0),
        ("He owes -17 dollars", "-17", 1.0),
        ("The answer is -3.5.", "-3.5", 1.0),
        ("about 2.50 litres", "2.5", 1.0),
        ("They sold 1,234 cakes.", "1234", 1.0),
        ("They sold 1234 cakes", "1,234", 1.0),
        ("I have 1,234, and then 5", "5", 1.0),  # the last number, not part of 1,234
        ("half of 3/2 is 3/4", "0.75", 1.0),
        ("0.3333333", "1/3", 1.0),  # relative tolerance 1e-6
        ("0.3333", "1/3", 0.0),
        ("5-3 leaves 2", "2", 1.0),
        ("5 - 3 = 7", "2", 0.0),  # wrong answer
        ("first 10 then 20", "10", 0.0),  # only the last number counts
        ("I do not know", "12", 0.0),  # no number
        ("  Yes ", "yes", 1.0),  # text answers compared normalised
        ("$x + 1$", "x + 1", 1.0),
        (r"\boxed{12}", "13", 0.0),
    ],
)
def test_math_cases(response, answer, want):
    out = resolve_reward("math").score(_items((response, answer)))
    assert out.rewards[0] == want, (response, answer)
    assert not out.failed.any()


def test_math_without_answer_fails_that_sample_only():
    out = resolve_reward("math").score(_items(("7", None), ("7", "7")))
    assert out.failed.tolist() == [True, False] and out.rewards[1] == 1.0
    assert "math" in out.errors[0] and '"answer"' in out.errors[0]


# --- user functions -------------------------------------------------------------------------

USER_MODULE = """
import math

def length(prompt, response, answer):
    return len(response) / 10

def picky(prompt, response, answer):
    if response == "boom":
        raise ValueError("cannot score boom\\nsecond line")
    if response == "nan":
        return math.nan
    if response == "str":
        return "high"
    if response == "none":
        return None
    return 1.0 if answer == response else 0.5

def both(prompts, responses, answers):
    return [float(r == a) for r, a in zip(responses, answers)]
both.batched = True

def short(prompts, responses, answers):
    return [1.0]
short.batched = True

def batch_raises(prompts, responses, answers):
    raise RuntimeError("reward server down")
batch_raises.batched = True

def two_args(prompt, response):
    return 1.0

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """The same functions as an importable module (unique name) and as a file."""
    name = f"rl_user_rewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, tmp_path / f"{name}.py"


def test_user_function_by_module_and_by_file(user_module):
    name, file = user_module
    items = _items(("abcd", None), ("", "x"))
    for spec in (f"{name}:length", f"{file}:length"):
        fn = resolve_reward(spec)
        out = fn.score(items)
        assert fn.name == spec
        assert out.rewards.tolist() == [0.4, 0.0] and not out.failed.any() and out.errors == []


def test_failing_samples_fail_alone(user_module):
    _, file = user_module
    out = resolve_reward(f"{file}:picky").score(
        _items(("ok", "ok"), ("boom", "x"), ("fine", "x"), ("nan", "x"), ("str", "x"), ("none", "x"))
    )
    assert out.failed.tolist() == [False, True, False, True, True, True]
    assert out.rewards[0] == 1.0 and out.rewards[2] == 0.5 and np.isnan(out.rewards[out.failed]).all()
    assert len(out.errors) == 4 and all("\n" not in e for e in out.errors)
    assert out.errors[0] == "sample 1 (prompt 0): ValueError: cannot score boom"
    assert "sample 3" in out.errors[1] and "not a finite number" in out.errors[1]
    assert "sample 4" in out.errors[2] and "str 'high'" in out.errors[2] and "not a number" in out.errors[2]
    assert "NoneType" in out.errors[3]


def test_batched_functions(user_module):
    name, _ = user_module
    items = _items(("a", "a"), ("b", "c"), ("d", "d"))
    out = resolve_reward(f"{name}:both").score(items)
    assert out.rewards.tolist() == [1.0, 0.0, 1.0] and not out.failed.any()
    short = resolve_reward(f"{name}:short").score(items)
    assert short.failed.all() and np.isnan(short.rewards).all() and len(short.errors) == 3
    assert "returned 1 values for 3 samples" in short.errors[0]
    down = resolve_reward(f"{name}:batch_raises").score(items)
    assert down.failed.all() and "RuntimeError: reward server down" in down.errors[2]


@pytest.mark.parametrize(
    "spec, words",
    [
        ("", "empty"),
        ("accuracy", "not known"),
        ("rl_no_such_module_xyz:fn", "cannot import module 'rl_no_such_module_xyz'"),
        ("{module}:missing", "has no attribute 'missing'"),
        ("{module}:NOT_A_FUNCTION", "not a function"),
        ("{module}:two_args", "three positional arguments"),
        ("{file}:missing", "has no attribute 'missing'"),
        ("nowhere/rewards.py:fn", "does not exist"),
        ("{module}:", "module:function"),
    ],
)
def test_bad_specs_are_user_errors(user_module, spec, words):
    name, file = user_module
    spec = spec.format(module=name, file=file)
    with pytest.raises(UserError) as e:
        resolve_reward(spec)
    msg = str(e.value)
    assert words in msg and "\n" not in msg
    if spec:
        assert repr(spec) in msg


def test_file_that_fails_to_import(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import no_such_package_abc\n")
    with pytest.raises(UserError, match="importing .*broken.py failed .*ModuleNotFoundError"):
        resolve_reward(f"{bad}:fn")


# --- reward models --------------------------------------------------------------------------

TEXTS = [
    ("count 3 to 7=", "3 4 5 6 7"),
    ("add 12+5=", "17"),
    ("rev abc=", "cba xyz long tail"),
    ("sort 9 1=", ""),
    ("repeat ab 3=", "ab ab ab"),
]
TOL = 1e-4


def _reward_model(folder, kind: str, num_labels: int = 1):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from rlsched.executor.model.builtin import write_tokenizer

    torch.manual_seed(7)
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=num_labels,
        pad_token_id=0,
    )
    model = getattr(transformers, f"{kind}ForSequenceClassification")(config).eval()
    with torch.no_grad():  # HF initialises biases 0 and norms 1: randomise all
        for pname, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if pname.endswith("norm.weight") else p.normal_(0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, 64)
    return model


@pytest.mark.parametrize("kind", ["Llama", "Qwen2"])
def test_reward_model_equals_transformers(tmp_path, kind):
    import torch

    from rlsched.executor.rl.rewards import RewardModel

    hf = _reward_model(tmp_path / kind, kind)
    fn = resolve_reward(f"model:{tmp_path / kind}")
    items = [RewardInput(p, r, None, prompt_id=i, sample_id=i) for i, (p, r) in enumerate(TEXTS)]
    ours = fn.score(items)
    small = RewardModel(tmp_path / kind, batch_size=2).score(items)  # several ragged batches
    assert not ours.failed.any() and ours.errors == []

    rows = [fn.tokenizer.encode(p + r, add_special_tokens=False).ids for p, r in TEXTS]
    assert all(0 not in row for row in rows) and len({len(r) for r in rows}) == len(rows)
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=(ids != 0).long()).logits[:, 0].numpy()
    assert np.abs(ours.rewards - want).max() < TOL, (ours.rewards, want)
    assert np.abs(small.rewards - want).max() < TOL
    assert np.std(want) > 1e-3  # the texts really score differently


def test_reward_model_refusals(tmp_path):
    transformers = pytest.importorskip("transformers")
    from rlsched.executor.model.builtin import write_tokenizer
    from rlsched.executor.rl.rewards import RewardModel

    two = tmp_path / "two"
    _reward_model(two, "Llama", num_labels=2)  # transformers writes no id2label for its default, 2
    with pytest.raises(UserError, match=r"score.weight has shape \(2, 32\) \(num_labels=2\); .*num_labels=1"):
        resolve_reward(f"model:{two}")
    raw = json.loads((two / "config.json").read_text())
    raw["id2label"] = {"0": "bad", "1": "good", "2": "great"}
    (two / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match=r"config.json: field 'id2label' gives 3 labels; .*num_labels=1"):
        resolve_reward(f"model:{two}")

    with pytest.raises(UserError, match="does not exist"):
        resolve_reward(f"model:{tmp_path / 'absent'}")

    lm = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
        )
    )
    lm.save_pretrained(tmp_path / "lm", safe_serialization=True)
    write_tokenizer(tmp_path / "lm", 64)
    with pytest.raises(UserError, match="ForSequenceClassification"):
        resolve_reward(f"model:{tmp_path / 'lm'}")
    cfg = tmp_path / "lm" / "config.json"
    cfg.write_text(cfg.read_text().replace("LlamaForCausalLM", "LlamaForSequenceClassification"))
    with pytest.raises(UserError, match="no score.weight"):
        RewardModel(tmp_path / "lm")
