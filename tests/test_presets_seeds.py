"""Job presets shaped like the published jobs (ReSpec's GRPO on math with Qwen2.5 3B/7B/14B, an
RLHFSpec-like PPO RLHF job): they load, the inference stage holds the actor's old log-prob
recompute in closed form, and generation takes the share of the RL step the papers report."""

import pytest

from rlsched.config import load_config
from rlsched.sim.rlstep import StageCosts
from rlsched.sim.simulate import simulate

RESPEC = {"respec-qwen2.5-3b": "qwen2.5-3b", "respec-qwen2.5-7b": "qwen2.5-7b", "respec-qwen2.5-14b": "qwen2.5-14b"}
RLHFSPEC = "rlhfspec-llama3.1-8b-ppo"
SEEDED = [*RESPEC, RLHFSPEC]


@pytest.mark.parametrize("name", SEEDED)
def test_seed_presets_load(name):
    cfg = load_config(name)
    assert cfg.name == name and cfg.description and cfg.hardware.name == "h100-sxm"
    assert cfg.cluster.instances * cfg.cluster.tp == 16  # 2 nodes x 8 GPUs
    assert cfg.rl.recompute_old_logprobs and cfg.rl.reference


@pytest.mark.parametrize("name", list(RESPEC))
def test_respec_presets_are_grpo_with_an_eagle_drafter(name):
    cfg = load_config(name)
    assert cfg.model.name == RESPEC[name]
    assert [(d.name, d.kind) for d in cfg.drafters] == [("eagle", "eagle")]
    assert 0.5 < cfg.drafters[0].acceptance.mean < 0.85
    assert cfg.workload.samples_per_prompt > 1 and not cfg.rl.critic and cfg.rl.reward_model is None


def test_rlhfspec_preset_is_ppo_with_critic_and_reward_model():
    cfg = load_config(RLHFSPEC)
    assert cfg.workload.samples_per_prompt == 1 and cfg.rl.critic and cfg.rl.reward_model is not None


def test_old_logprob_recompute_adds_one_actor_forward_to_inference():
    on = load_config("respec-qwen2.5-7b")
    off = load_config("respec-qwen2.5-7b", overrides=["rl.recompute_old_logprobs=false"])
    c_on, c_off = StageCosts(on), StageCosts(off)
    tokens = 1_234_567
    forward = 2.0 * on.model.params * tokens / c_on.infer_rate
    assert c_on.infer_rate == c_off.infer_rate
    assert c_on.inference(tokens) - c_off.inference(tokens) == pytest.approx(forward, rel=1e-12)
    # with the reference: two actor-sized forwards; without it, the recompute alone
    ref_off = StageCosts(load_config("respec-qwen2.5-7b", overrides=["rl.reference=false"]))
    assert c_on.inference(tokens) == pytest.approx(2 * forward, rel=1e-12)
    assert ref_off.inference(tokens) == pytest.approx(forward, rel=1e-12)
    # training and generation are untouched
    assert c_on.training(tokens) == c_off.training(tokens)


def test_recompute_shows_in_the_simulated_inference_stage():
    small = ["workload.prompts=4", "workload.response_len.max=256", "workload.prompt_len.max=128"]
    on = load_config("respec-qwen2.5-7b", overrides=small)
    off = load_config("respec-qwen2.5-7b", overrides=[*small, "rl.recompute_old_logprobs=false"])
    r_on, r_off = simulate(on, "off").records[0], simulate(off, "off").records[0]
    tokens = r_on.prompt_tokens + r_on.response_tokens
    assert tokens == r_off.prompt_tokens + r_off.response_tokens  # the same rollout
    rate = StageCosts(on).infer_rate
    assert r_on.inference_s - r_off.inference_s == pytest.approx(2.0 * on.model.params * tokens / rate, rel=1e-9)
    assert r_on.generation_s == pytest.approx(r_off.generation_s) and r_on.training_s == r_off.training_s


@pytest.mark.parametrize("name", SEEDED)
def test_generation_share_matches_the_papers(name):
    """RLHFSpec: generation above 68% of RLHF time; ReSpec, TLT: 70-90% (no speculation)."""
    rec = simulate(load_config(name), "off").records[0]
    share = rec.generation_s / rec.total_s
    assert 0.65 <= share <= 0.90, share
    assert rec.total_s == pytest.approx(rec.generation_s + rec.inference_s + rec.training_s + rec.drafter_update_s)
