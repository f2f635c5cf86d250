import pytest
import torch

from textrl.ppo.advantages import gae, whiten
from textrl.ppo.losses import entropy_over_allowed, explained_variance, ppo_loss


def reference_gae(rewards, values, dones, gamma, lam):
    """The textbook loop, in plain Python."""
    adv, last, n = [0.0] * len(rewards), 0.0, len(rewards)
    for t in reversed(range(n)):
        next_value = 0.0 if dones[t] or t == n - 1 else values[t + 1]
        carry = 0.0 if dones[t] else last
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * carry
        adv[t] = last
    return adv, [a + v for a, v in zip(adv, values)]


def test_gae_equals_a_plain_reference_loop():
    g = torch.Generator().manual_seed(0)
    for n in [1, 2, 7, 40]:
        rewards = torch.randn(n, generator=g, dtype=torch.float64)
        values = torch.randn(n, generator=g, dtype=torch.float64)
        dones = (torch.rand(n, generator=g) < 0.2).double()
        dones[-1] = 1
        adv, ret = gae(rewards, values, dones, 0.99, 0.95)
        ref_adv, ref_ret = reference_gae(rewards.tolist(), values.tolist(), dones.tolist(), 0.99, 0.95)
        assert adv.tolist() == pytest.approx(ref_adv, abs=1e-12)
        assert ret.tolist() == pytest.approx(ref_ret, abs=1e-12)


def test_gae_hand_computed_two_step_episode():
    adv, ret = gae(torch.tensor([0.0, 1.9]), torch.tensor([-0.1, -0.1]), torch.tensor([0.0, 1.0]), 0.9, 0.5)
    # last: delta = 1.9 + 0.1 = 2.0; first: delta = 0 + 0.9 * -0.1 + 0.1 = 0.01, adv = 0.01 + 0.45 * 2.0
    assert adv.tolist() == pytest.approx([0.91, 2.0])
    assert ret.tolist() == pytest.approx([0.81, 1.9])


def test_whiten_and_explained_variance():
    x = torch.tensor([1.0, 2.0, 3.0, 6.0])
    w = whiten(x)
    assert float(w.mean()) == pytest.approx(0, abs=1e-6) and float(w.std()) == pytest.approx(1, abs=1e-6)
    assert explained_variance(x, x) == 1.0
    assert explained_variance(torch.full_like(x, x.mean()), x) == pytest.approx(0.0)


def test_ppo_loss_is_clipped_and_entropy_covers_only_allowed_tokens():
    logits = torch.zeros(2, 5)
    allowed = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    ent = entropy_over_allowed(torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), -1))
    assert ent.tolist() == pytest.approx([torch.log(torch.tensor(2.0)).item(), torch.log(torch.tensor(4.0)).item()])
    tokens = torch.tensor([0, 2])
    new = torch.log(torch.tensor([0.5, 0.25]))
    old = new - torch.tensor([0.5, 0.0])  # first ratio = e^0.5 > 1.2: clipped
    terms = ppo_loss(logits, allowed, tokens, torch.ones(2), old, torch.tensor([1.0, 1.0]), torch.zeros(2),
                     torch.zeros(2), clip=0.2, vf_coef=0.05, ent_coef=0.01)
    assert float(terms.policy) == pytest.approx(-(1.2 + 1.0) / 2)
    assert float(terms.clipfrac) == 0.5
    assert float(terms.ratio_mean) == pytest.approx((torch.exp(torch.tensor(0.5)).item() + 1) / 2)
