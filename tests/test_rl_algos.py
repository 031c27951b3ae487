"""The RL update's maths against closed forms and hand-computed cases."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rlsched.executor.rl.algos import (  # noqa: E402
    aggregate,
    gae,
    grpo_advantages,
    make_batch,
    policy_loss,
    terminal_rewards,
    token_logprobs,
    value_loss,
)
from rlsched.executor.rl.distill import ReplayBuffer, ReplaySample, reward_weights  # noqa: E402


def test_make_batch_places_response_positions_and_logprobs():
    b = make_batch(
        [[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], [[-0.1, -0.2], [-0.3, -0.4, -0.5]], pad_id=0, valid=[True, False]
    )
    assert b.ids.tolist() == [[5, 6, 7, 9, 10], [8, 11, 12, 13, 0]]
    # row 0: positions 2, 3 predict the response tokens 9, 10; row 1 is left out of the loss
    assert b.mask.tolist() == [[False, False, True, True], [False] * 4]
    assert b.old_logp[0].tolist() == pytest.approx([0, 0, -0.1, -0.2])
    assert b.old_logp[1].tolist() == pytest.approx([-0.3, -0.4, -0.5, 0])


def test_grpo_advantages_normalise_within_groups_only():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 5.0, 1.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    valid = torch.tensor([True, True, True, True, True, True, True, False])
    adv = grpo_advantages(r, g, valid, normalise_std=True)
    # group 0: mean 0.25, std sqrt(3)/4
    assert adv[:4].tolist() == pytest.approx([0.75 / (math.sqrt(3) / 4), *[-0.25 / (math.sqrt(3) / 4)] * 3], rel=1e-5)
    assert adv[4:6].tolist() == [0.0, 0.0]  # equal rewards teach nothing
    assert adv[6].item() == 0.0 and adv[7].item() == 0.0  # a lone valid sample, an invalid one
    raw = grpo_advantages(r, g, valid, normalise_std=False)
    assert raw[:4].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_gae_matches_the_recursion_and_lambda_one_gives_monte_carlo_returns():
    torch.manual_seed(0)
    values = torch.randn(2, 6)
    mask = torch.tensor([[False, True, True, True, False, False], [False, False, True, True, True, True]])
    rewards = torch.zeros(2, 6)
    rewards[0, 3], rewards[1, 5] = 1.0, -2.0
    gamma, lam = 0.9, 0.8
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for i in range(2):
        pos = mask[i].nonzero().flatten().tolist()
        last = 0.0
        for j, t in reversed(list(enumerate(pos))):
            nv = values[i, pos[j + 1]].item() if j + 1 < len(pos) else 0.0
            delta = rewards[i, t].item() + gamma * nv - values[i, t].item()
            last = delta + gamma * lam * last
            assert adv[i, t].item() == pytest.approx(last, abs=1e-5)
        assert adv[i, ~mask[i]].abs().sum() == 0
    adv1, ret1 = gae(rewards, values, mask, 1.0, 1.0)
    # lambda = gamma = 1: the return of every response position is the final reward
    assert ret1[0, mask[0]].tolist() == pytest.approx([1.0] * 3, abs=1e-5)
    assert ret1[1, mask[1]].tolist() == pytest.approx([-2.0] * 4, abs=1e-5)


def test_terminal_rewards_sit_at_the_last_response_position():
    b = make_batch([[1, 2], [3]], [[4, 5, 6], [7]], [[0.0] * 3, [0.0]], pad_id=0)
    tr = terminal_rewards(torch.tensor([2.0, -1.0]), b)
    assert tr[0].tolist() == [0, 0, 0, 2.0] and tr[1].tolist() == [-1.0, 0, 0, 0]


def test_policy_loss_clips_like_ppo():
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3, dtype=torch.bool)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, st = policy_loss(logp, old, adv, mask, clip_eps=0.2, agg="token")
    # per token: -min(r A, clip(r) A): -1.2 (clipped up), -0.5 (unclipped: pessimistic), +1.1
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.1) / 3, abs=1e-6)
    assert st["clip_frac"] == pytest.approx(2 / 3)


def test_policy_loss_gradient_at_ratio_one_is_advantage_weighted_logp():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = policy_loss(
        logp, logp.detach(), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool), 0.2, "token"
    )
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-1.0, 0.5])


def test_kl_penalty_is_zero_at_the_reference_and_positive_away():
    logp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    base, _ = policy_loss(logp, logp, torch.zeros(1, 2), mask, 0.2, "token")
    same, st = policy_loss(logp, logp, torch.zeros(1, 2), mask, 0.2, "token", ref_logp=logp, kl_coef=1.0)
    assert same.item() == pytest.approx(base.item()) and st["kl_ref"] == pytest.approx(0.0)
    away, st = policy_loss(logp, logp, torch.zeros(1, 2), mask, 0.2, "token", ref_logp=logp - 0.5, kl_coef=1.0)
    assert st["kl_ref"] == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    assert away.item() > base.item()


def test_aggregation_token_versus_sequence():
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, True], [True, False, False, False]])
    assert aggregate(x, mask, "token").item() == pytest.approx(8 / 5)
    assert aggregate(x, mask, "sequence").item() == pytest.approx((1 + 4) / 2)


def test_value_loss_clips_the_new_value():
    old = torch.zeros(1, 1)
    ret = torch.full((1, 1), 3.0)
    mask = torch.ones(1, 1, dtype=torch.bool)
    # the value jumps from 0 to 2: the clipped value 0.2 is further from the return 3 and counts
    assert value_loss(torch.full((1, 1), 2.0), old, ret, mask, 0.2, "token").item() == pytest.approx(0.5 * 2.8**2)
    # a move within the clip range is the plain squared error
    assert value_loss(torch.full((1, 1), 0.1), old, ret, mask, 0.2, "token").item() == pytest.approx(0.5 * 2.9**2)


def test_token_logprobs_agree_with_a_manual_softmax():
    torch.manual_seed(0)

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.randn(7, 7)

        def forward(self, ids):
            return self.table[ids]

    m = Bigram()
    ids = torch.tensor([[1, 2, 3, 4]])
    lp = token_logprobs(m, ids, temperature=0.5)
    want = [torch.log_softmax(m.table[a] / 0.5, -1)[b].item() for a, b in zip([1, 2, 3], [2, 3, 4])]
    assert lp[0].tolist() == pytest.approx(want, abs=1e-6)


def test_reward_weights_have_mean_one_and_favour_high_rewards():
    w = reward_weights(np.array([0.0, 0.0, 1.0, 1.0, 1.0, 0.0]), "reward", 0.25, 3.0)
    assert w.mean() == pytest.approx(1.0)
    assert w[2] > w[0] and w.max() / w.min() == pytest.approx(2.0 / 0.25)  # 1 +- 1, the low end clipped
    assert (reward_weights(np.array([0.0, 1.0]), "plain", 0.25, 3.0) == 1.0).all()
    assert (reward_weights(np.array([0.5, 0.5]), "reward", 0.25, 3.0) == 1.0).all()  # no spread: all equal


def test_replay_buffer_keeps_the_last_rollouts_and_drops_failed_or_empty_samples():
    buf = ReplayBuffer(2)
    for step in range(3):
        buf.add(
            [
                ReplaySample([1, 2, 3], 2, float(step)),
                ReplaySample([1, 2], 2, 1.0),
                ReplaySample([1, 2, 4], 2, float("nan")),
            ]
        )
    assert [s.reward for s in buf.samples()] == [1.0, 2.0]
