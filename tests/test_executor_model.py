"""The executor's model equals transformers' logits (float32, 1e-4) on tiny random checkpoints
written with save_pretrained: a full prompt, then incremental steps through the KV cache with
rows of different lengths, q = 1 and q = 3, ragged rows and dropped tokens. Bad folders give
one UserError naming the problem."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from rlsched.errors import UserError  # noqa: E402
from rlsched.executor.model.loading import load_config, load_model  # noqa: E402

TOL = 1e-4
VOCAB = 97
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}  # short, so every branch of the ramp is used

# name -> (config class, model class, config kwargs, save kwargs)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, {}),
    "llama-llama3-tied": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=LLAMA3, tie_word_embeddings=True), {}),
    "llama-linear-bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True, mlp_bias=True),
        {},
    ),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True), {}),
    "qwen2-sharded": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False), dict(max_shard_size="60KB")),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24), {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24), {}),
}

MAX_DIFF: dict[str, float] = {}  # worst difference seen per model, printed at the end with -s


def _write(folder, name):
    cfg_cls, model_cls, extra, save = MODELS[name]
    torch.manual_seed(list(MODELS).index(name))  # hash() would differ per process
    config = getattr(transformers, cfg_cls)(**SMALL, **extra)
    model = getattr(transformers, model_cls)(config).eval()
    # HF initialises biases to 0 and norms to 1: randomise all, so every weight is checked.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
    model.save_pretrained(folder, safe_serialization=True, **save)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: (root / name, _write(root / name, name)) for name in MODELS}


def _ref(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def _check(name, got, want):
    diff = (got - want).abs().max().item()
    MAX_DIFF[name] = max(MAX_DIFF.get(name, 0.0), diff)
    assert diff < TOL, f"{name}: max logit difference {diff:.2e}"


@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_equals_transformers(models, name):
    folder, hf = models[name]
    model = load_model(folder).model
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 13), generator=g)
    want = torch.stack([_ref(hf, row.tolist()) for row in ids])
    with torch.no_grad():
        _check(name, model(ids), want)  # no cache: each row from position 0
        cache = model.new_cache(2, 16)
        _check(name, model(ids, cache), want)
        last = model.new_cache(2, 16)
        _check(name, model(ids, last, last_only=True)[:, 0], want[:, -1])
    assert cache.lengths.tolist() == [13, 13]


@pytest.mark.parametrize("name,max_tokens", [("llama", -1), ("qwen2-tied", -1), ("qwen3", -1), ("llama", 100)])
def test_wide_ragged_batch_equals_transformers(models, name, max_tokens, monkeypatch):
    """12 rows of very different lengths in scattered slots of a 16-row cache: `prefill` splits
    them into length groups (and, with max_tokens = 100, each group into forwards of at most
    100 padded tokens); a 3-token step takes the batched-matmul attention with a ragged mask,
    a 1-token step SDPA with one and the next the batched matmuls (which a 1-token step takes
    from `BMM_MIN_BATCH` rows); then rows move to other slots (as the engine compacts) and a
    last step reads them there."""
    from rlsched.executor.decode.speculative import length_groups, prefill
    from rlsched.executor.model import transformer as model_module

    folder, hf = models[name]
    model = load_model(folder).model
    g = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    lengths = [4, 90, 7, 60, 12, 85, 5, 33, 70, 9, 48, 20]
    assert len(length_groups([n - 1 for n in lengths])) > 1
    seqs = [rand(n) for n in lengths]
    slots = torch.tensor([15, 0, 3, 7, 1, 12, 9, 4, 14, 2, 10, 6])
    cache = model.new_cache(16, 100)
    with torch.no_grad():
        last = prefill(model, cache, slots, seqs, max_tokens)
        assert last.tolist() == [s[-1] for s in seqs]
        for q, bmm_min_batch in ((3, 32), (1, 32), (1, 2)):
            monkeypatch.setattr(model_module, "BMM_MIN_BATCH", bmm_min_batch)
            new = [[s[-1]] + rand(q - 1) for s in seqs]
            out = model(torch.tensor(new), cache, slots=slots)
            for r, t in enumerate(new):
                seqs[r] = seqs[r] + t[1:]
                _check(name, out[r], _ref(hf, seqs[r])[-q:])
            seqs = [s + rand(1) for s in seqs]  # each row's next token, fed by the next step
        for src, dst in [(12, 5), (14, 8), (15, 11)]:  # into the holes below 12, as the engine does
            cache.move(src, dst)
            slots[slots == src] = dst
        assert sorted(slots.tolist()) == list(range(12)) and cache.lengths[12:].sum() == 0
        out = model(torch.tensor([[s[-1]] for s in seqs]), cache, slots=slots)
    for r, s in enumerate(seqs):
        _check(name, out[r, 0], _ref(hf, s)[-1])


@pytest.mark.parametrize("name", list(MODELS))
def test_incremental_decode_equals_transformers(models, name):
    """Two rows of different lengths in cache rows 2 and 0 of 4: a ragged prefill, a 1-token
    step, a 3-token step, then rows keep 1 and 3 of those (as after verification), then a
    ragged step (2 and 1 new tokens) and a last 1-token step. Each row's logits equal
    transformers' on that row's own sequence."""
    folder, hf = models[name]
    model = load_model(folder).model
    g = torch.Generator().manual_seed(2)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    seqs = [rand(5), rand(9)]
    slots = torch.tensor([2, 0])
    cache = model.new_cache(4, 24)

    def step(new: list[list[int]]):
        q = max(len(t) for t in new)
        ids = torch.tensor([t + [0] * (q - len(t)) for t in new])
        with torch.no_grad():
            out = model(ids, cache, slots=slots, n_new=[len(t) for t in new])
        for r, t in enumerate(new):
            seqs[r] = seqs[r] + t
            _check(name, out[r, : len(t)], _ref(hf, seqs[r])[-len(t) :])
        assert cache.lengths[slots].tolist() == [len(s) for s in seqs]

    prompts, seqs = seqs, [[], []]
    step(prompts)
    step([rand(1), rand(1)])
    step([rand(3), rand(3)])
    keep = [len(seqs[0]) - 2, len(seqs[1])]  # row 0 drops 2 of its 3, row 1 keeps all
    cache.trim(slots, keep)
    seqs = [s[:k] for s, k in zip(seqs, keep)]
    step([rand(2), rand(1)])
    step([rand(1), rand(1)])
    assert [len(s) for s in seqs] == [10, 15]


def test_dynamic_rope_prefill_equals_transformers(tmp_path):
    """NTK-dynamic scaling: within max_position_embeddings it is plain RoPE; beyond, the base
    grows with the longest position of the forward (as transformers does on a fresh model)."""
    config = transformers.LlamaConfig(
        **SMALL, max_position_embeddings=12, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
    )
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path).model
    assert not torch.equal(model.rope._inv(20), model.rope.inv_freq)  # scaling does act at 20
    for n in (20, 10):  # longest first: transformers keeps the largest length it has seen
        ids = torch.randint(0, VOCAB, (1, n))
        with torch.no_grad():
            _check("llama-dynamic", model(ids)[0], _ref(hf, ids[0].tolist()))


def test_sliding_window_beyond_the_window_is_refused(models):
    folder, _ = models["mistral"]
    loaded = load_model(folder)
    assert loaded.config.sliding_window == 24
    with pytest.raises(ValueError, match="sliding window"):
        loaded.model(torch.zeros(1, 25, dtype=torch.long))


def test_cache_bounds_are_checked(models):
    model = load_model(models["llama"][0]).model
    cache = model.new_cache(2, 8)
    ids = torch.zeros(2, 6, dtype=torch.long)
    model(ids, cache, n_new=[6, 4])
    with pytest.raises(ValueError, match="more than the cache's max_len 8"):
        model(ids[:, :3], cache)  # row 0 would need 9 positions
    with pytest.raises(ValueError, match="n_new must lie in"):
        model(ids[:, :2], cache, n_new=[3, 1])
    with pytest.raises(ValueError, match="only shorten"):
        cache.trim([1], [5])
    cache.free([0])
    assert cache.lengths.tolist() == [0, 4]
    with pytest.raises(ValueError, match="max_batch 2"):
        model(torch.zeros(3, 1, dtype=torch.long), cache)


def test_bfloat16_is_close_to_float32(models):
    folder, _ = models["qwen2-tied"]
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        f32 = load_model(folder).model(ids)
        m16 = load_model(folder, dtype="bfloat16").model
        assert m16.embed.weight.dtype == torch.bfloat16
        b16 = m16(ids, m16.new_cache(2, 11))
    assert b16.dtype == torch.float32
    assert (b16 - f32).abs().max().item() < 0.05 * f32.abs().max().item()


def test_sharded_checkpoint_has_an_index(models):
    folder, _ = models["qwen2-sharded"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_tokenizer_loaded_when_present(models, tmp_path):
    from tokenizers import Tokenizer
    from tokenizers import models as tok_models

    folder, _ = models["llama"]
    assert load_model(folder).tokenizer is None
    copy = tmp_path / "with-tok"
    shutil.copytree(folder, copy)
    tok = Tokenizer(tok_models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.save(str(copy / "tokenizer.json"))
    assert load_model(copy).tokenizer.token_to_id("b") == 1
    (copy / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="tokenizer.json"):
        load_model(copy)


# --- bad folders ----------------------------------------------------------------------------


def _copy(models, tmp_path, name="llama"):
    dst = tmp_path / "m"
    shutil.copytree(models[name][0], dst)
    return dst


def _edit_config(folder, **changes):
    raw = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    (folder / "config.json").write_text(json.dumps(raw))


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(UserError, match=r"has no config\.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(UserError, match="not valid JSON"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(model_type="gpt2"), r"field 'model_type' is 'gpt2'; supported: llama"),
        (dict(model_type=None), r"field 'model_type' is missing"),
        (dict(hidden_size=None), r"field 'hidden_size' is missing"),
        (dict(num_attention_heads="four"), r"field 'num_attention_heads' must be a positive integer"),
        (dict(num_key_value_heads=3), r"field 'num_key_value_heads' \(3\) must divide"),
        (dict(hidden_act="gelu"), r"field 'hidden_act' is 'gelu'"),
        (
            dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
            r"field 'rope_parameters.rope_type' is 'yarn'; supported",
        ),
        (
            dict(rope_parameters=None, rope_scaling={"type": "longrope"}),
            r"field 'rope_scaling.rope_type' is 'longrope'",
        ),
        (
            dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}),
            r"field 'rope_parameters.original_max_position_embeddings'",
        ),
    ],
)
def test_bad_config_fields(models, tmp_path, change, message):
    folder = _copy(models, tmp_path)
    _edit_config(folder, **change)
    with pytest.raises(UserError, match=message) as err:
        load_model(folder)
    assert str(folder) in str(err.value)


def test_v4_style_rope_scaling_is_read(models, tmp_path):
    folder = _copy(models, tmp_path, "llama-llama3-tied")
    raw = json.loads((folder / "config.json").read_text())
    params = raw.pop("rope_parameters")
    theta = params.pop("rope_theta")
    _edit_config(folder, rope_parameters=None, rope_theta=theta, rope_scaling=params)
    new, old = load_config(folder), load_config(models["llama-llama3-tied"][0])
    assert new == old and new.rope_scaling.kind == "llama3"


def test_missing_unexpected_and_misshapen_weights(models, tmp_path):
    folder = _copy(models, tmp_path)
    file = folder / "model.safetensors"
    good = load_file(file)
    bad = dict(good)
    del bad["model.layers.1.mlp.up_proj.weight"]
    save_file(bad, file)
    with pytest.raises(UserError, match=r"missing weight\(s\) model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(folder)
    save_file({**good, "model.layers.0.extra.weight": torch.zeros(2)}, file)
    with pytest.raises(UserError, match=r"unexpected weight\(s\) model\.layers\.0\.extra\.weight"):
        load_model(folder)
    save_file({**good, "model.norm.weight": torch.zeros(3)}, file)
    with pytest.raises(UserError, match=r"model\.norm\.weight has shape \(3,\)"):
        load_model(folder)
    file.write_bytes(b"garbage")
    with pytest.raises(UserError, match="cannot read"):
        load_model(folder)
    file.unlink()
    with pytest.raises(UserError, match=r"no \*\.safetensors"):
        load_model(folder)


def test_missing_shard(models, tmp_path):
    folder = _copy(models, tmp_path, "qwen2-sharded")
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(UserError, match=f"shard.*{shard.name}.*missing"):
        load_model(folder)


def test_bad_dtype_and_device(models):
    folder, _ = models["llama"]
    with pytest.raises(UserError, match="dtype 'float16' is not supported"):
        load_model(folder, dtype="float16")
    with pytest.raises(UserError, match="device"):
        load_model(folder, device="tpu")


def test_zz_report_max_differences():
    """Printed with `pytest -s`: the worst logit difference per model over the tests above."""
    for name, diff in sorted(MAX_DIFF.items()):
        print(f"max |logit difference| {name}: {diff:.2e}")


@pytest.mark.parametrize("name", ["qwen2-tied", "qwen3"])
def test_compiled_decode_equals_transformers(models, name):
    """The compiled batch-1 forwards (`compile_decode`): a 1-token step, a 2-token step of
    which one token is kept (as after a rejected draft), a step on the last token only, in
    cache row 1 of 2; each equals transformers, every one went through a compiled graph, and
    a prefill longer than the graphs ran eager."""
    folder, hf = models[name]
    model = load_model(folder).model
    model.compile_decode(max_new=2)
    graph, calls = model.compiled._graph, []
    model.compiled._graph = lambda *a: calls.append(a[0].shape) or graph(*a)
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, VOCAB, (6,), generator=g).tolist()
    slots = torch.tensor([1])
    with torch.inference_mode():  # as the engine runs (the graphs were compiled for it)
        cache = model.new_cache(2, 16)
        out = model(torch.tensor([seq]), cache, slots=slots)
        assert calls == []  # 6 new tokens: eager
        _check(name, out[0], _ref(hf, seq))
        for new, keep, last_only in (([5], 1, False), ([7, 8], 1, False), ([9], 1, True)):
            out = model(torch.tensor([new]), cache, slots=slots, n_new=[keep], last_only=last_only)
            seq = seq + new
            want = _ref(hf, seq)[-len(new) :]
            _check(name, out[0], want[keep - 1 : keep] if last_only else want)
            seq = seq[: len(seq) - len(new) + keep]
            assert cache.lengths.tolist() == [0, len(seq)]
    assert [tuple(s) for s in calls] == [(1, 1), (1, 2), (1, 1)]


def test_compiled_rows_equal_transformers_with_one_graph_for_every_batch_and_length(models):
    """The compiled forward of two or more rows (`compile_decode(max_batch=...)`): rows of
    different lengths take one new token and then two (each row keeping its own number of
    them, as after a verify); every row's logits equal transformers for its own sequence. The
    same graphs then serve three rows and longer reads without compiling again."""
    import torch._dynamo.utils

    folder, hf = models["qwen3"]
    model = load_model(folder).model
    model.compile_decode(max_new=2, max_batch=4)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    calls, graph = [], model.compiled._graph
    model.compiled._graph = lambda *a: calls.append(tuple(a[0].shape)) or graph(*a)
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for rows, lengths in ((4, (3, 7, 5, 9)), (3, (12, 20, 16))):
            seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
            cache = model.new_cache(rows, 32)
            for i, s in enumerate(seqs):  # prefills, one row at a time (eager)
                model(torch.tensor([s]), cache, slots=torch.tensor([i]))
            new = torch.randint(0, VOCAB, (rows, 1), generator=g)
            out = model(new, cache)
            seqs = [s + [int(t)] for s, t in zip(seqs, new[:, 0])]
            for i, s in enumerate(seqs):
                _check("qwen3", out[i, 0], _ref(hf, s)[-1])
            new = torch.randint(0, VOCAB, (rows, 2), generator=g)
            keep = torch.tensor([1 + i % 2 for i in range(rows)])
            out = model(new, cache, n_new=keep)
            for i, s in enumerate(seqs):
                want = _ref(hf, s + new[i].tolist())[-2:]
                _check("qwen3", out[i], want)
                seqs[i] = s + new[i, : int(keep[i])].tolist()
            assert cache.lengths.tolist() == [len(s) for s in seqs]
    assert calls == [(4, 1), (4, 2), (3, 1), (3, 2)]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
