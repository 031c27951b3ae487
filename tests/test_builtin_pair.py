"""The built-in tiny pair and model saving: HF-compatible folders, a target that learned its
tasks, a drafter that agrees with it often but not always; the pair the package ships (the
default recipe's, bfloat16 weights) and its regeneration."""

import collections
import dataclasses
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rlsched.executor.decode.sampling import GREEDY, SamplingParams  # noqa: E402
from rlsched.executor.model.builtin import (  # noqa: E402
    EOS,
    SHIPPED,
    BuiltinPair,
    Recipe,
    built_pair,
    builtin_pair,
    decode,
    encode,
    export_builtin,
    shipped_pair,
)
from rlsched.executor.model.loading import load_model  # noqa: E402
from rlsched.executor.model.saving import save_model  # noqa: E402
from rlsched.executor.model.transformer import ModelConfig, Transformer  # noqa: E402
from rlsched.tasks.synthetic import TASKS, exact_match, make_examples  # noqa: E402


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_saved_models_load_back_with_the_same_logits(tmp_path, model_type):
    c = ModelConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qkv_bias=model_type == "qwen2",
        model_type=model_type,
    )
    torch.manual_seed(0)
    m = Transformer(c)
    m.rope.materialize("cpu")
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    save_model(m, tmp_path / "m")
    back = load_model(tmp_path / "m").model
    ids = torch.randint(0, 40, (2, 9))
    assert torch.allclose(m(ids), back(ids), atol=1e-6)


def test_the_pair_is_a_pair_of_hf_folders(pair):
    import transformers

    for folder in (pair.target, pair.drafter):
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    ours = load_model(pair.target)
    hf = transformers.AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(pair.target)
    text = "sort 5 12 3=3 5 12"
    ids = tok(text)["input_ids"]
    assert ids == encode(text) == ours.tokenizer.encode(text).ids and decode(ids) == text
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.allclose(ours.model(x), hf(x).logits, atol=1e-4)
    assert pair.info["target_params"] > 3 * pair.info["drafter_params"]


def _rollout(pair, sampling, examples, k=4):
    from rlsched.executor.decode.drafters import ModelDrafter
    from rlsched.executor.engine.rollout import RolloutEngine
    from rlsched.executor.engine.rows import Request

    target = load_model(pair.target).model
    drafter = load_model(pair.drafter).model
    engine = RolloutEngine(
        target,
        ModelDrafter(drafter, sampling, 64, 300),
        64 * 300,
        64,
        sampling,
        f"static:{k}",
        generator=torch.Generator().manual_seed(0),
    )
    return engine.run([Request(encode(e.prompt), i, i, 160, EOS) for i, e in enumerate(examples)])


@pytest.mark.e2e  # minutes of generation on a loaded machine: `make test`, not `make test-fast`
def test_the_target_learned_some_tasks(pair):
    """Greedy answers on held-out prompts. A random model scores 0 on everything. Writing the
    right answer is learned well on the copying tasks (count, repeat); stopping right after it
    (exact match: answer, then end-of-sequence) only sometimes, which is what RL is left to
    teach. Two builds from the same recipe measured: answer written, count 1.0 / 1.0, repeat
    0.74 / 0.61; exact match over all tasks 0.15 / 0.07 (training is not bit-reproducible
    across code versions and machines, so the bounds are loose)."""
    examples = make_examples(200, seed=777)
    result = _rollout(pair, GREEDY, examples)
    written, exact = collections.defaultdict(list), []
    for e, sample in zip(examples, result.samples):
        written[e.task].append(decode(sample.tokens).startswith(e.answer))
        toks = sample.tokens[:-1] if sample.tokens and sample.tokens[-1] == EOS else sample.tokens
        exact.append(exact_match(decode(toks), e.answer))
    score = {t: float(np.mean(v)) for t, v in written.items()}
    assert set(score) == set(TASKS)
    assert score["count"] >= 0.8 and score["repeat"] >= 0.4, score
    assert 0.02 <= float(np.mean(exact)) <= 0.9, float(np.mean(exact))


def test_the_drafter_agrees_often_but_not_always(pair):
    """Sampling at temperature 1 with k = 4 drafts: mean accepted length (tokens per step,
    at most 5) well above 1 and below 5. Measured: 3.4."""
    result = _rollout(pair, SamplingParams(temperature=1.0), make_examples(64, seed=5))
    assert 2.0 <= result.stats["mean_accept_len"] <= 4.8, result.stats


# --- the shipped pair -----------------------------------------------------------------------

SHIPPED_FILES = {"build.json"} | {
    f"{w}/{n}"
    for w in ("target", "drafter")
    for n in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
}


def _files(root):
    """Relative path -> (size, mtime) of every file and folder under root, hidden ones included."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return out


def _dtypes(folder):
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as h:
        return {h.get_slice(name).get_dtype() for name in h.keys()}  # noqa: SIM118 - not a dict


def test_the_shipped_pair_is_the_default_recipes():
    """The package ships the default recipe's pair: its build.json names the recipe and its
    hash, and builtin_pair() returns it."""
    shipped = shipped_pair()
    assert shipped is not None, f"no shipped pair in {SHIPPED}: see rlsched/executor/model/builtin.py to regenerate it"
    recipe = Recipe()
    assert shipped.info["key"] == recipe.key(), (
        "the shipped pair was built from another recipe: regenerate it with "
        "`python -m rlsched.executor.model.builtin --export rlsched/executor/model/builtin_pair`"
    )
    assert shipped.info["recipe"] == json.loads(json.dumps(dataclasses.asdict(recipe)))
    assert builtin_pair() == shipped and builtin_pair(recipe) == shipped
    assert shipped.info["weights_dtype"] == "bfloat16"
    for folder in (shipped.target, shipped.drafter):
        assert folder.parent == SHIPPED


def test_the_shipped_weights_are_bfloat16_on_disk_and_load_in_float32():
    shipped = shipped_pair()
    assert set(_files(SHIPPED)) - {"target", "drafter"} == SHIPPED_FILES
    for folder in (shipped.target, shipped.drafter):
        assert _dtypes(folder) == {"BF16"}
        assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
        model = load_model(folder).model
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert all(torch.equal(p, p.to(torch.bfloat16).float()) for p in model.parameters())
    assert shipped.info["target_params"] == sum(p.numel() for p in load_model(shipped.target).model.parameters())


def test_the_shipped_pair_is_used_read_only_and_needs_no_cache(tmp_path, monkeypatch):
    """Loading and running the shipped pair (ours and transformers') creates no cache folder
    and writes nothing into the package's folder."""
    import transformers

    cache = tmp_path / "cache"
    monkeypatch.setenv("RLSCHED_CACHE", str(cache))
    before = _files(SHIPPED)
    pair = builtin_pair()
    _rollout(pair, GREEDY, make_examples(4, seed=1))
    transformers.AutoTokenizer.from_pretrained(pair.target)
    transformers.AutoModelForCausalLM.from_pretrained(pair.drafter, dtype=torch.float32)
    assert not cache.exists()
    assert _files(SHIPPED) == before


def _profile(pair, n=32, seed=5, k=4):
    """Mean accepted length (tokens a step, at most k + 1) greedy and sampling at temperature 1,
    on fixed prompts."""
    examples = make_examples(n, seed=seed)
    return {
        "greedy": _rollout(pair, GREEDY, examples, k).stats["mean_accept_len"],
        "sampled": _rollout(pair, SamplingParams(temperature=1.0), examples, k).stats["mean_accept_len"],
    }


def test_the_shipped_pairs_acceptance_is_in_the_expected_range():
    """On a few prompts, greedy and sampled: the range test_the_drafter_agrees_often_but_not_always
    expects (greedy agrees at least as often as sampling)."""
    profile = _profile(shipped_pair(), n=8)
    assert 2.0 <= profile["sampled"] <= 4.8 and 2.0 <= profile["greedy"] <= 4.8, profile
    assert profile["greedy"] >= profile["sampled"] - 0.2, profile


# A tiny recipe that builds in seconds: the build, cache and export paths without the real training.
TINY = Recipe(
    max_len=64,
    target=(("hidden_size", 32), ("intermediate_size", 64), ("num_layers", 2), ("num_heads", 2), ("num_kv_heads", 1)),
    drafter=(("hidden_size", 32), ("intermediate_size", 64), ("num_layers", 1), ("num_heads", 2), ("num_kv_heads", 1)),
    stages=((1, 3), (2, 3)),
    drafter_steps=3,
    batch=4,
)


def test_another_recipe_is_built_into_the_cache_and_exports_to_bfloat16(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSCHED_CACHE", str(tmp_path / "cache"))
    before = _files(SHIPPED)
    pair = builtin_pair(TINY)
    assert pair.target.parent == tmp_path / "cache" / f"builtin-{TINY.key()}" and pair.info["key"] == TINY.key()
    assert _dtypes(pair.target) == {"F32"}
    out = export_builtin(tmp_path / "export", TINY)
    info = json.loads((out / "build.json").read_text())
    assert info["key"] == TINY.key() and info["weights_dtype"] == "bfloat16"
    assert set(_files(out)) - {"target", "drafter"} == SHIPPED_FILES
    x = torch.tensor([encode("count 3 7=")])
    for which in ("target", "drafter"):
        assert _dtypes(out / which) == {"BF16"}
        full, half = load_model(getattr(pair, which)).model, load_model(out / which).model
        for (name, a), (_, b) in zip(full.named_parameters(), half.named_parameters()):
            assert torch.equal(a.to(torch.bfloat16).float(), b), name
        assert torch.allclose(full(x), half(x), atol=0.05)
    assert built_pair(TINY) == pair  # cached: not rebuilt
    assert _files(SHIPPED) == before


# How far the rebuilt pair's mean accepted length (32 prompts, k = 4, at most 5) may be from the
# shipped pair's. Training is not bit-reproducible across machines and thread counts, and the
# shipped weights are rounded to bfloat16; greedy rollouts of one pair repeat exactly, sampled
# ones differ from run to run even with the same weights, hence the wider sampled bound.
REBUILD_TOLERANCE = {"greedy": 0.15, "sampled": 0.4}


@pytest.mark.slow
def test_a_rebuild_from_the_recipe_gives_the_shipped_acceptance(tmp_path, monkeypatch):
    """Trains the default recipe afresh (minutes), exports it as the package would ship it, and
    compares the acceptance profile with the shipped pair's."""
    monkeypatch.setenv("RLSCHED_CACHE", str(tmp_path / "cache"))
    rebuilt = built_pair(log=print)
    out = export_builtin(tmp_path / "export", log=print)
    exported = BuiltinPair(out / "target", out / "drafter", json.loads((out / "build.json").read_text()))
    ours = _profile(shipped_pair())
    theirs = {"fp32": _profile(rebuilt), "bf16": _profile(exported)}
    print(f"shipped {ours}, rebuilt {theirs}")
    for profile in theirs.values():
        for mode in ("greedy", "sampled"):
            assert abs(profile[mode] - ours[mode]) <= REBUILD_TOLERANCE[mode], (mode, ours, theirs)
