import pytest
import torch

from textrl.policy.decoding import Action, Decision
from textrl.policy.distribution import entropy
from textrl.ppo.advantages import episode_gae, gae, whiten
from textrl.ppo.losses import DecisionBatch, LossCoefs, explained_variance, ppo_loss
from textrl.rollout import Episode, Step


def decision_advantages(episode, values, gamma, lam):
    """``episode_gae`` on plain lists: (advantages, returns) of the episode's decisions."""
    adv, ret = episode_gae(episode, torch.tensor(values, dtype=torch.float64), gamma, lam)
    return adv.tolist(), ret.tolist()


def reference_gae(rewards, values, gamma, lam, last_value=0.0):
    """The textbook loop over turns, in plain Python."""
    adv, running, next_value = [0.0] * len(rewards), 0.0, last_value
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
        next_value = values[t]
    return adv, [a + v for a, v in zip(adv, values)]


def test_gae_equals_a_plain_reference_loop():
    g = torch.Generator().manual_seed(0)
    for n in [1, 2, 7, 40]:
        rewards = torch.randn(n, generator=g, dtype=torch.float64)
        values = torch.randn(n, generator=g, dtype=torch.float64)
        for last in [0.0, 0.7]:
            adv, ret = gae(rewards, values, torch.full((n,), 0.99, dtype=torch.float64), 0.95, last)
            ref_adv, ref_ret = reference_gae(rewards.tolist(), values.tolist(), 0.99, 0.95, last)
            assert adv.tolist() == pytest.approx(ref_adv, abs=1e-12)
            assert ret.tolist() == pytest.approx(ref_ret, abs=1e-12)


def test_gae_hand_computed_two_step_episode():
    adv, ret = gae(torch.tensor([0.0, 1.9]), torch.tensor([-0.1, -0.1]), torch.tensor([0.9, 0.9]), 0.5)
    # last: delta = 1.9 + 0.1 = 2.0; first: delta = 0 + 0.9 * -0.1 + 0.1 = 0.01, adv = 0.01 + 0.45 * 2.0
    assert adv.tolist() == pytest.approx([0.91, 2.0])
    assert ret.tolist() == pytest.approx([0.81, 1.9])


def turn(reward, values, truncated=False, terminated=False):
    """A step whose command took len(values) decisions (forks), with those value estimates."""
    decisions = [Decision(index=k, allowed=[1, 2], token=1, logprob=-0.5, value=v) for k, v in enumerate(values)]
    return Step(None, [], Action("cmd", [1] * (len(values) + 1), decisions, 1.0), reward, terminated, truncated, "")


def test_gae_is_per_turn_and_shared_by_a_commands_decisions_including_truncation():
    """Turns: a one-fork command, a three-fork command (`unlock X with Y`), a forced command (no
    decision), a two-fork command cut by the step limit; the cut state is worth 0.4."""
    gamma, lam = 0.9, 0.8
    steps = [turn(-0.1, [0.2]), turn(-0.1, [0.3, 0.5, 0.6]), turn(0.9, []), turn(-0.1, [0.1, -0.2], truncated=True)]
    episode = Episode("g", steps, bootstrap_value=0.4)
    values = [0.2, 0.3, 0.5, 0.6, 0.1, -0.2]
    adv, ret = decision_advantages(episode, values, gamma, lam)

    # per-turn reference: the forced turn's reward joins turn 2, one step later; the cut bootstraps
    rewards, first, discounts = [-0.1, -0.1 + gamma * 0.9, -0.1], [0.2, 0.3, 0.1], [gamma, gamma**2, gamma]
    turn_adv, next_value, running = [0.0] * 3, 0.4, 0.0
    for j in reversed(range(3)):
        running = rewards[j] + discounts[j] * next_value - first[j] + discounts[j] * lam * running
        turn_adv[j], next_value = running, first[j]
    turn_ret = [a + v for a, v in zip(turn_adv, first)]
    expected_ret = [turn_ret[0]] + [turn_ret[1]] * 3 + [turn_ret[2]] * 2
    assert ret == pytest.approx(expected_ret, abs=1e-12)
    assert adv == pytest.approx([r - v for r, v in zip(expected_ret, values)], abs=1e-12)
    assert adv[1] == pytest.approx(turn_adv[1]) and adv[4] == pytest.approx(turn_adv[2])  # first decisions

    # terminated instead of truncated: nothing after the last turn
    steps[-1] = turn(-0.1, [0.1, -0.2], terminated=True)
    _, ended = decision_advantages(Episode("g", steps), values, gamma, lam)
    assert ended[-1] == pytest.approx(-0.1)
    # a truncated episode without its bootstrap value is refused, not silently treated as ended
    steps[-1] = turn(-0.1, [0.1, -0.2], truncated=True)
    with pytest.raises(ValueError, match="bootstrap"):
        decision_advantages(Episode("g", steps), values, gamma, lam)


def test_discounting_does_not_depend_on_how_many_forks_a_command_has():
    one = Episode("g", [turn(-0.1, [0.0]), turn(1.9, [0.0], terminated=True)])
    many = Episode("g", [turn(-0.1, [0.0, 0.0, 0.0, 0.0]), turn(1.9, [0.0], terminated=True)])
    _, ret_one = decision_advantages(one, [0.0, 0.0], 0.9, 1.0)  # lambda 1: the discounted return
    _, ret_many = decision_advantages(many, [0.0] * 5, 0.9, 1.0)
    assert ret_one[0] == pytest.approx(-0.1 + 0.9 * 1.9)
    assert ret_many[:4] == pytest.approx([ret_one[0]] * 4)


def test_whiten_and_explained_variance():
    x = torch.tensor([1.0, 2.0, 3.0, 6.0])
    w = whiten(x)
    assert float(w.mean()) == pytest.approx(0, abs=1e-6) and float(w.std()) == pytest.approx(1, abs=1e-6)
    assert explained_variance(x, x) == 1.0
    assert explained_variance(torch.full_like(x, x.mean()), x) == pytest.approx(0.0)


def test_ppo_loss_is_clipped_summed_and_normalised_and_entropy_covers_only_allowed_tokens():
    logits = torch.zeros(2, 5)
    allowed = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    ent = entropy(torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), -1))
    assert ent.tolist() == pytest.approx([torch.log(torch.tensor(2.0)).item(), torch.log(torch.tensor(4.0)).item()])
    tokens = torch.tensor([0, 2])
    new = torch.log(torch.tensor([0.5, 0.25]))
    old = new - torch.tensor([0.5, 0.0])  # first ratio = e^0.5 > 1.2: clipped
    batch = DecisionBatch(logits, allowed, tokens, torch.ones(2), old, torch.tensor([1.0, 1.0]), torch.zeros(2),
                          torch.zeros(2))
    terms = ppo_loss(batch, LossCoefs(clip=0.2, vf_coef=0.05, ent_coef=0.01, kl_coef=0.0, explore=0.0), normalizer=5.0)
    assert float(terms.policy) == pytest.approx(-(1.2 + 1.0))
    assert float(terms.clipped) == 1.0
    assert float(terms.ratio) == pytest.approx(torch.exp(torch.tensor(0.5)).item() + 1)
    assert float(terms.loss) == pytest.approx((-(1.2 + 1.0) - 0.01 * float(ent.sum())) / 5.0)
    assert terms.log_ratio.tolist() == pytest.approx([0.5, 0.0])
