"""rlsched's policies inside vLLM (`executor/vllm/hook.py`) keep vLLM's sampling lossless.

A tiny random Llama pair (vocab 16, written with transformers; the drafter is the target with
noise on its weights) runs through vLLM's CPU build with the PolicyScheduler. The first 3
tokens of many samples are tested against their exact distribution under plain sampling,
computed with transformers by enumerating all 16^3 continuations (samples run 8 tokens, so
chains up to 6 are verified within them): chi-square goodness of fit
(cells expected below 5 pooled), p > 0.001, at T = 1 and at T = 0.7 with top-p 0.9, for a
policy that cycles k over {0, 1, 3, 6} step by step and for a per-request k. A hook that keeps
the wrong end of each cut chain (the drafts no longer match their probabilities) must fail.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("vllm")

from plugin_policies import Cycling  # noqa: E402
from test_speculative import chi2_gof  # noqa: E402

from rlsched.executor.decode.sampling import SamplingParams  # noqa: E402
from rlsched.policies.acceptance import AcceptanceEstimator  # noqa: E402

pytestmark = pytest.mark.vllm

V = 16
ALPHA = 1e-3
PROMPTS = [[3, 5, 7, 3, 5, 7, 3, 5], [1, 2, 9, 1, 2, 9, 1, 2, 9, 1]]
N_ROWS = 1500  # per prompt
CASES = {"t1.0": SamplingParams(1.0), "t0.7-p0.9": SamplingParams(0.7, top_p=0.9)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return noisy_pair(tmp_path_factory.mktemp("vllm-hook"))


def noisy_pair(root):
    """A tiny random Llama target and its drafter (the target with noise on its weights)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=V - 1,
    )
    hf = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    hf.save_pretrained(root / "target")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    hf.save_pretrained(root / "drafter")
    return root / "target", root / "drafter"


@pytest.fixture(scope="module")
def llm(folders):
    from rlsched.executor.vllm.scheduler import PolicyScheduler
    from rlsched.executor.vllm.shims import start_llm

    llm = start_llm(
        folders[0],
        {
            "method": "draft_model",
            "model": str(folders[1]),
            "num_speculative_tokens": 6,
            "draft_sample_method": "probabilistic",
        },
        max_batch=256,
        max_model_len=64,
        seed=0,
        dtype="float32",
        scheduler_cls=PolicyScheduler,
        in_process=True,  # (the tests give the scheduler hooks of their own, `attach`)
    )
    yield llm


@torch.no_grad()
def exact_joint(folder, prompt: list[int], sp: SamplingParams) -> torch.Tensor:
    """P(first 3 tokens = a, b, c) under plain sampling, (V, V, V), by enumeration with transformers."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()

    def last(seqs):
        return sp.probs(model(torch.tensor(seqs)).logits[:, -1].float())

    p1 = last([prompt])[0]
    p2 = last([prompt + [a] for a in range(V)])
    p3 = last([prompt + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def _generate(llm, hook, sp: SamplingParams, seed: int):
    from vllm import SamplingParams as VP
    from vllm.inputs import TokensPrompt

    from rlsched.executor.vllm.scheduler import attach

    prompts = [p for p in PROMPTS for _ in range(N_ROWS)]
    attach(llm, hook)
    hook.begin(np.repeat(np.arange(len(PROMPTS)), N_ROWS))
    params = VP(
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k or -1,
        max_tokens=8,
        ignore_eos=True,
        detokenize=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    hook.end()
    return [list(o.outputs[0].token_ids) for o in outs]


def _p_value(folders, sp, gen) -> float:
    ps = []
    for i, prompt in enumerate(PROMPTS):
        t = torch.tensor([g[:3] for g in gen[i * N_ROWS : (i + 1) * N_ROWS]])
        counts = torch.bincount(t[:, 0] * V * V + t[:, 1] * V + t[:, 2], minlength=V**3)
        ps.append(chi2_gof(counts, exact_joint(folders[0], prompt, sp)))
    return min(ps) * len(ps)  # Bonferroni over the prompts


def _hook(policy, hook_cls=None, records=None):
    from rlsched.executor.vllm.hook import StepHook

    return (hook_cls or StepHook)(
        policy, AcceptanceEstimator(["model"]), "model", 6, record=None if records is None else records.append
    )


@pytest.mark.parametrize("per_request", [False, True], ids=["k-per-step", "k-per-request"])
@pytest.mark.parametrize("case", list(CASES))
def test_policy_chosen_k_is_lossless(llm, folders, case, per_request):
    policy, records = Cycling(per_request=per_request), []
    hook = _hook(policy, records=records)
    gen = _generate(llm, hook, CASES[case], seed=11 + per_request)
    decode = [r for r in records if r["kind"] == "decode"]
    if per_request:  # rows drafted different lengths in one step
        assert sum(r["drafted"] for r in decode) < sum(r["batch"] * r["k"] for r in decode)
    else:  # k really changed from step to step
        assert {0, 1, 3}.issubset({r["k"] for r in decode})
    drafted, accepted = sum(r["drafted"] for r in records), sum(r["accepted"] for r in records)
    assert accepted > 0.3 * drafted > 0
    assert hook.estimator.mean("model") > 0.3
    p = _p_value(folders, CASES[case], gen)
    print(f"vllm hook {case} per_request={per_request}: p = {p:.3g}, accepted {accepted / drafted:.2f}")
    assert p > ALPHA


def test_cutting_the_wrong_end_of_a_chain_is_caught(llm, folders):
    from rlsched.executor.vllm.hook import StepHook

    class WrongEnd(StepHook):
        def trim(self, draft):
            for i, (req_id, toks) in enumerate(zip(draft.req_ids, draft.draft_token_ids)):
                k = self._k_of.get(req_id)
                if k and len(toks) > k:
                    draft.draft_token_ids[i] = toks[-k:]

    gen = _generate(llm, _hook(Cycling(per_request=True), WrongEnd), CASES["t1.0"], seed=5)
    p = _p_value(folders, CASES["t1.0"], gen)
    print(f"vllm hook, wrong end of the chain kept: p = {p:.3g}")
    assert p < ALPHA
