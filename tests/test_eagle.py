"""EAGLE-3 draft heads (rlsched/executor/decode/eagle.py): shapes and the draft vocabulary, the
unrolled training-time test, drafting, reward-weighted freshening, the vLLM folder layout, and
the built-in pair's head."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rlsched.errors import UserError  # noqa: E402
from rlsched.executor.decode.eagle import (  # noqa: E402
    VLLM_ARCHITECTURE,
    VLLM_CONFIG_FIELDS,
    VLLM_WEIGHTS,
    EagleHead,
    HeadConfig,
    default_aux_layers,
    load_head,
    save_head,
    target_features,
)
from rlsched.executor.decode.eagle_builtin import init_head  # noqa: E402
from rlsched.executor.decode.eagle_drafter import draft  # noqa: E402
from rlsched.executor.decode.eagle_train import distill_head, frequent_tokens, train_head, ttt_loss  # noqa: E402
from rlsched.executor.decode.sampling import SamplingParams  # noqa: E402
from rlsched.executor.model.transformer import ModelConfig, Transformer  # noqa: E402

VOCAB, AUX = 40, (1, 2, 4)


def tiny_target(seed: int = 0) -> Transformer:
    c = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    m = Transformer(c)
    m.rope.materialize("cpu")
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    return m.eval().requires_grad_(False)


def tiny_head(target: Transformer, draft_vocab: int = 24, seed: int = 1) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(HeadConfig.for_target(target.config, draft_vocab=draft_vocab, aux_layers=AUX), target)
    head.set_vocab(range(VOCAB - draft_vocab, VOCAB))  # the top ids: offsets are not zero
    init_head(head, std=0.2)
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_aux_layers_default_to_vllms_choice():
    assert default_aux_layers(16) == (2, 8, 13) and default_aux_layers(32) == (2, 16, 29)
    with pytest.raises(ValueError, match="give aux_layers explicitly"):
        default_aux_layers(4)
    with pytest.raises(ValueError, match="ascending"):
        HeadConfig.for_target(tiny_target().config, draft_vocab=8, aux_layers=(3, 1, 2))


def test_shapes_and_the_draft_vocabulary_mapping(target):
    head = tiny_head(target)
    ids = torch.tensor([3, 7, 8] + list(range(19, 40)))
    head.set_vocab(ids.flip(0))  # any order: kept ascending
    assert torch.equal(head.draft_ids, ids.sort().values)
    assert torch.equal(head.d2t, head.draft_ids - torch.arange(24))  # EAGLE-3: target = draft + d2t[draft]
    assert head.t2d.dtype == torch.bool and int(head.t2d.sum()) == 24 and bool(head.t2d[ids].all())
    assert not head.t2d[[0, 1, 2, 4]].any()
    with pytest.raises(ValueError, match="24 distinct ids"):
        head.set_vocab([1] * 24)

    x = torch.randint(0, VOCAB, (2, 9))
    aux, logits = target_features(target, x, AUX)
    assert aux.shape == (2, 9, 3 * 32) and torch.allclose(logits, target(x), atol=1e-5)
    steps = head.unroll(aux[:, :8], torch.cat([x[:, 1:], x[:, :2]], 1), 3)
    assert [s.shape for s in steps] == [(2, 8, 24)] * 3

    tokens, probs = draft(head, aux, x, 5, SamplingParams(1.0), torch.Generator().manual_seed(0))
    assert tokens.shape == (2, 5) and probs.shape == (2, 5, VOCAB)
    assert bool(head.t2d[tokens].all())  # drafts lie in the draft vocabulary ...
    assert torch.allclose(probs.sum(-1), torch.ones(2, 5)) and float(probs[:, :, ~head.t2d].abs().sum()) == 0
    assert bool((probs.gather(-1, tokens[..., None]) > 0).all())  # ... and are drawn from probs


def test_aux_states_are_the_residual_stream_entering_each_layer(target):
    x = torch.randint(0, VOCAB, (1, 6))
    aux, _ = target_features(target, x, (0, 4))
    assert torch.allclose(aux[..., :32], target.embed.weight[x])  # id 0: the embeddings
    assert torch.allclose(target.norm(aux[..., 32:]), target.features(x), atol=1e-5)  # id L: before the final norm


def test_training_lowers_the_loss(target):
    head = tiny_head(target)
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(4):
        ids = torch.randint(0, VOCAB, (8, 12), generator=g)
        data.append((ids, torch.ones(8, 11, dtype=torch.bool)))
    stats = train_head(target, head, data, epochs=15, lr=1e-2, ttt_steps=3)
    assert stats["loss_last"] < 0.6 * stats["loss_first"], stats
    assert len(stats["kl_steps"]) == 3
    assert not any(p.requires_grad for p in head.parameters())
    assert not any(p.requires_grad for p in target.parameters())  # the target is not trained


def test_the_unrolled_steps_read_the_heads_own_output_not_later_target_states(target):
    head = tiny_head(target)
    x = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    aux, _ = target_features(target, x, AUX)
    tokens = torch.cat([x[:, 1:], x[:, :2]], 1)
    base = head.unroll(aux[:, :9], tokens, 3)
    t = 4
    # the target's states after anchor t (positions t+1.. that step j > 0 predicts from) are not read
    later = aux.clone()
    later[:, t + 1 :] += 5 * torch.randn_like(later[:, t + 1 :])
    moved = head.unroll(later[:, :9], tokens, 3)
    for j in range(3):
        assert torch.allclose(moved[j][:, : t + 1], base[j][:, : t + 1], atol=1e-5), j
        assert not torch.allclose(moved[j][:, t + 1 :], base[j][:, t + 1 :], atol=1e-3), j
    # ... while what the head itself output at step 0 is: nudge step 0's layer output only
    calls = []

    def nudge(module, inputs, output):
        calls.append(1)
        return output + 1.0 if len(calls) == 1 else output

    handle = head.mlp.register_forward_hook(nudge)
    try:
        nudged = head.unroll(aux[:, :9], tokens, 3)
    finally:
        handle.remove()
    assert len(calls) == 3
    assert not torch.allclose(nudged[1][:, t], base[1][:, t], atol=1e-3)
    assert not torch.allclose(nudged[2][:, t], base[2][:, t], atol=1e-3)


def test_greedy_drafts_are_the_unrolled_chain_fed_its_own_drafts(target):
    head = tiny_head(target)
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    aux, _ = target_features(target, x, AUX)
    k, t = 4, 7
    tokens, probs = draft(head, aux[:, :t], x[:, 1 : t + 1], k)
    assert torch.equal(probs.argmax(-1), tokens) and torch.allclose(probs.sum(-1), torch.ones(2, k))
    fed = torch.cat([x[:, 1 : t + 1], tokens[:, : k - 1]], 1)  # anchor t-1's chain, teacher-forced with the drafts
    steps = head.unroll(aux[:, :t], fed, k)
    again = torch.stack([head.draft_ids[s[:, t - 1].argmax(-1)] for s in steps], 1)
    assert torch.equal(again, tokens)


def test_saved_folder_is_vllms_eagle3_layout_and_loads_back_with_identical_drafts(target, tmp_path):
    from safetensors.torch import load_file

    head = tiny_head(target)
    save_head(head, tmp_path / "head")
    files = {p.name for p in (tmp_path / "head").iterdir()}
    assert files == {"config.json", "model.safetensors"}
    state = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert set(state) == set(VLLM_WEIGHTS)  # no embed_tokens: vLLM shares the target's
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert state["fc.weight"].shape == (32, 3 * 32) and state["lm_head.weight"].shape == (24, 32)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (32, 2 * 32)  # embedding + fused state in
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert set(VLLM_CONFIG_FIELDS) <= set(config)
    assert config["architectures"] == [VLLM_ARCHITECTURE] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 24 and config["vocab_size"] == VOCAB
    assert (
        config["eagle_aux_hidden_state_layer_ids"]
        == list(AUX)
        == config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    )

    back = load_head(tmp_path / "head", target)
    assert not any(n.startswith("target") for n in back.state_dict())
    x = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(5))
    aux, _ = target_features(target, x, AUX)
    for sampling in (SamplingParams(0.0), SamplingParams(0.8, top_k=10)):
        a = draft(head, aux, x, 4, sampling, torch.Generator().manual_seed(6))
        b = draft(back, aux, x, 4, sampling, torch.Generator().manual_seed(6))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_folder_that_is_not_a_head_is_one_line(target, tmp_path):
    with pytest.raises(UserError, match="config.json is missing"):
        load_head(tmp_path, target)
    save_head(tiny_head(target), tmp_path / "h")
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    del raw["draft_vocab_size"]
    (tmp_path / "h" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match="no field 'draft_vocab_size'"):
        load_head(tmp_path / "h", target)


def test_frequent_tokens_are_the_draft_vocabulary():
    ids = torch.tensor([[5, 1, 1, 1, 2, 2, 9]])
    mask = torch.tensor([[False, True, True, True, True, True]])  # next tokens 1, 1, 2, 2, 9 count
    assert frequent_tokens([(ids, mask)], 3, 12) == [1, 2, 9]
    assert frequent_tokens([(ids, mask)], 4, 12) == [0, 1, 2, 9]  # unseen ids fill up from the lowest


def test_reward_weights_scale_each_samples_tokens(target):
    """distill_head's rule is the drafter's: w(r) x KL per response token. Rewards 0 and 1 give
    weights 0 and 2: the first sample's tokens move nothing, the second's do."""
    from rlsched.executor.rl.distill import ReplayBuffer, ReplaySample

    def run(low, high):
        head = tiny_head(target)
        buf = ReplayBuffer(1)
        buf.add([ReplaySample(low, 3, 0.0), ReplaySample(high, 3, 1.0)])
        out = distill_head(
            target,
            head,
            torch.optim.SGD(head.parameters(), lr=0.5),
            buf,
            steps=2,
            batch=2,
            weighting="reward",
            weight_min=0.0,
            weight_max=2.0,
            temperature=1.0,
            generator=torch.Generator().manual_seed(0),
            pad_id=0,
        )
        assert out["samples"] == 2 and np.isfinite(out["kl_before"]) and np.isfinite(out["kl_after"])
        assert not head.training and not any(p.requires_grad for p in head.parameters())
        return [p.detach().clone() for p in head.parameters()]

    base = run([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16])
    low_changed = run([1, 2, 3, 20, 21, 22, 23, 24], [9, 10, 11, 12, 13, 14, 15, 16])
    high_changed = run([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 30, 31, 32, 33, 34])
    assert all(torch.equal(a, b) for a, b in zip(base, low_changed))
    assert not all(torch.equal(a, b) for a, b in zip(base, high_changed))


@pytest.fixture(scope="module")
def builtin():
    from rlsched.executor.decode.eagle_builtin import builtin_head

    return builtin_head()


def test_the_builtin_head_drafts_for_the_builtin_target(builtin):
    from rlsched.executor.decode.sampling import GREEDY
    from rlsched.executor.decode.speculative import generate
    from rlsched.executor.model.builtin import EOS, encode
    from rlsched.executor.model.loading import load_model
    from rlsched.tasks.synthetic import make_examples

    assert builtin.folder.name == f"eagle-{builtin.info['key']}"
    assert builtin.info["loss_last"] < builtin.info["loss_first"]
    target = load_model(builtin.target).model
    head = load_head(builtin.folder, target)
    assert head.config.aux_layers == (2, 8, 13)
    prompts = [encode(e.prompt) for e in make_examples(8, seed=12345)]
    outs, _, _ = generate(target, prompts, 24, GREEDY)
    hits = total = 0
    for p, o in zip(prompts, outs):
        o = o[: o.index(EOS) + 1] if EOS in o else o
        s = torch.tensor([p + o])
        aux, _ = target_features(target, s, head.config.aux_layers)
        for n in range(len(p) + 1, s.shape[1]):  # first draft after each position of the response
            tok, _ = draft(head, aux[:, : n - 1], s[:, 1:n], 1)
            hits += int(tok[0, 0] == s[0, n])
            total += 1
    assert hits / total > 0.5, (hits, total)


def test_ttt_loss_weights_steps_by_decay(target):
    head = tiny_head(target)
    x = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(8))
    aux, logits = target_features(target, x, AUX)
    mask = torch.ones(2, 9, dtype=torch.bool)
    flat, kls = ttt_loss(head, aux, logits, x, mask, ttt_steps=3)
    assert len(kls) == 3 and abs(float(flat) - float(np.mean(kls))) < 1e-5
    first, _ = ttt_loss(head, aux, logits, x, mask, ttt_steps=3, decay=0.0)
    assert abs(float(first) - kls[0]) < 1e-5
