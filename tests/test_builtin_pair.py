"""The built-in tiny pair and model saving: HF-compatible folders, a target that learned its
tasks, a drafter that agrees with it often but not always."""

import collections

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rlsched.executor.builtin import EOS, builtin_pair, decode, encode  # noqa: E402
from rlsched.executor.loading import load_model  # noqa: E402
from rlsched.executor.model import ModelConfig, Transformer  # noqa: E402
from rlsched.executor.saving import save_model  # noqa: E402
from rlsched.executor.speculative import generate  # noqa: E402
from rlsched.executor.sampling import GREEDY, SamplingParams  # noqa: E402
from rlsched.tasks.synthetic import TASKS, exact_match, make_examples  # noqa: E402


@pytest.fixture(scope="module")
def pair():
    return builtin_pair()


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_saved_models_load_back_with_the_same_logits(tmp_path, model_type):
    c = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, qkv_bias=model_type == "qwen2", model_type=model_type)
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


def test_the_target_learned_its_tasks(pair):
    """Greedy exact match on held-out prompts: the easy tasks mostly right, and well above
    chance on every task (a random model scores 0)."""
    target = load_model(pair.target).model
    examples = make_examples(100, seed=777)
    right = collections.defaultdict(list)
    prompts = [encode(e.prompt) for e in examples]
    out, _, _ = generate(target, prompts, max(len(e.answer) for e in examples) + 1, GREEDY)
    for e, toks in zip(examples, out):
        end = toks.index(EOS) if EOS in toks else len(toks)
        right[e.task].append(exact_match(decode(toks[:end]), e.answer))
    score = {t: float(np.mean(v)) for t, v in right.items()}
    assert set(score) == set(TASKS)
    assert np.mean([score["count"], score["repeat"]]) >= 0.6, score
    assert float(np.mean([v for vs in right.values() for v in vs])) >= 0.3, score


def test_the_drafter_agrees_often_but_not_always(pair):
    target = load_model(pair.target).model
    drafter = load_model(pair.drafter).model
    from rlsched.executor.drafters import ModelDrafter

    sp = SamplingParams(temperature=1.0)
    prompts = [encode(e.prompt) for e in make_examples(16, seed=5)]
    d = ModelDrafter(drafter, sp, 16, 256)
    _, _, stats = generate(target, prompts, 32, sp, drafter=d, k=4, generator=torch.Generator().manual_seed(0))
    rate = stats["accepted"] / stats["drafted"]
    assert 0.4 <= rate <= 0.97, rate
