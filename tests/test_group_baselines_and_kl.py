"""Group rollouts with GRPO / RLOO baselines, and the exact KL anchor, on real games and the tiny model."""

from dataclasses import replace

import pytest
import torch

from textrl.policy.distribution import kl_to_reference
from textrl.policy.model import build_policy
from textrl.games.env import Observation
from textrl.policy.decoding import Action, Decision
from textrl.ppo.advantages import gigpo, grpo, rloo, rollout_advantages
from textrl.rollout import Episode, Sampling, Step, episode_seeds, play_games
from textrl.training.curriculum import Curriculum
from textrl.training.module import PPOModule
from tests.conftest import config


def test_grpo_and_rloo_equal_a_reference_computation():
    returns = [1.9, -0.8, 1.7, 0.5, 0.5, 0.5, -0.3]
    groups = ["a", "a", "a", "b", "b", "b", "c"]  # "b" all alike, "c" alone: nothing to compare
    by_group = {g: [r for r, h in zip(returns, groups) if h == g] for g in groups}

    def ref_grpo(r, g):
        xs = by_group[g]
        mean = sum(xs) / len(xs)
        std = (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
        return (r - mean) / (std + 1e-8)

    def ref_rloo(r, g):
        xs = by_group[g]
        return r - (sum(xs) - r) / (len(xs) - 1) if len(xs) > 1 else 0.0

    t = torch.tensor(returns, dtype=torch.float64)
    assert grpo(t, groups).tolist() == pytest.approx([ref_grpo(r, g) for r, g in zip(returns, groups)], abs=1e-9)
    assert rloo(t, groups).tolist() == pytest.approx([ref_rloo(r, g) for r, g in zip(returns, groups)], abs=1e-12)
    assert grpo(t, groups)[3:].abs().max() == 0  # no preference inside an all-equal group, or a lone episode


def _turn(room: str, reward: float, forks: int = 1, done: bool = False) -> Step:
    obs = Observation("win", room, "You carry nothing.", "", ["a", "b"], 0, 1, False, False)
    decisions = [Decision(k, [1, 2], 1, -0.7, 0.0) for k in range(forks)]
    return Step(obs, [], Action("a", [1] * (forks + 1), decisions, 1.0), reward, done, False, "")


def test_gigpo_equals_a_direct_computation_on_a_group_with_repeated_states():
    gamma, weight = 0.9, 0.5
    # two episodes of game g: both start in the hall, both pass the kitchen (episode 0 twice); episode
    # 0's second turn has no decision (auto-advanced): no advantage, its reward counts for turn 0.
    # Game h: one episode, no state it shares
    e0 = Episode("g", [_turn("hall", -0.1), _turn("attic", -0.1, forks=0), _turn("kitchen", -0.1, forks=2),
                       _turn("kitchen", 1.9, done=True)], won=True)
    e1 = Episode("g", [_turn("hall", -0.1), _turn("kitchen", -0.1), _turn("cellar", -0.1)])
    e2 = Episode("h", [_turn("hall", -0.1), _turn("kitchen", 1.9, done=True)], won=True)

    def to_go(rewards):
        return [sum(r * gamma ** k for k, r in enumerate(rewards[t:])) for t in range(len(rewards))]

    g0, g1, g2 = to_go([-0.1, -0.1, -0.1, 1.9]), to_go([-0.1, -0.1, -0.1]), to_go([-0.1, 1.9])

    def z(x, xs):  # grpo's normalisation, by hand
        mean = sum(xs) / len(xs)
        std = (sum((v - mean) ** 2 for v in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
        return (x - mean) / (std + 1e-8)

    ep = [z(1.6, [1.6, -0.3]), z(-0.3, [1.6, -0.3]), 0.0]
    hall, kitchen = [g0[0], g1[0]], [g0[2], g0[3], g1[1]]
    expected = ([ep[0] + weight * z(g0[0], hall)]  # e0: hall, (attic: no decision), kitchen x 2 forks, kitchen
                + [ep[0] + weight * z(g0[2], kitchen)] * 2 + [ep[0] + weight * z(g0[3], kitchen)]
                + [ep[1] + weight * z(g1[0], hall), ep[1] + weight * z(g1[1], kitchen), ep[1]]  # cellar: alone
                + [ep[2], ep[2]])  # game h: nothing to compare with (its kitchen is another game's)
    counts = [4, 3, 2]
    advantages, returns = rollout_advantages([e0, e1, e2], torch.zeros(sum(counts)), gamma, 0.95, estimator="gigpo",
                                             normalize=False, step_weight=weight)
    assert advantages.tolist() == pytest.approx(expected, abs=1e-9)
    assert returns.tolist() == pytest.approx([1.6] * 4 + [-0.3] * 3 + [1.8] * 2)
    # the pure function on its own
    direct = gigpo(torch.tensor([1.0, 0.0]), ["g", "g"], torch.tensor([2.0, 0.0, 5.0]), ["s", "s", "t"],
                   torch.tensor([0, 1, 1]), weight=1.0)
    assert direct.tolist() == pytest.approx([2 * 2 ** -0.5, -2 * 2 ** -0.5, -(2 ** -0.5)], abs=1e-7)


def test_gigpo_is_grpo_when_no_state_repeats():
    episodes = [Episode("g", [_turn(f"room {i}-{t}", r, forks=1 + t % 2) for t, r in enumerate(rs)])
                for i, rs in enumerate([[-0.1, 1.9], [-0.1, -0.1, -0.1], [1.9]])]
    counts = [sum(len(s.action.decisions) for s in e.steps) for e in episodes]
    for normalize in (False, True):
        a, _ = rollout_advantages(episodes, torch.zeros(sum(counts)), 0.99, 0.95, estimator="gigpo", normalize=normalize)
        b, _ = rollout_advantages(episodes, torch.zeros(sum(counts)), 0.99, 0.95, estimator="grpo", normalize=normalize)
        assert a.tolist() == pytest.approx(b.tolist(), abs=1e-12)


def test_kl_over_allowed_tokens_equals_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, generator=g)
    children = [[1, 4], [0, 2, 7, 9], [5, 6, 8]]
    allowed = torch.zeros(3, 10, dtype=torch.bool)
    for i, c in enumerate(children):
        allowed[i, c] = True
    logp = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), -1)
    ref_logits = [torch.randn(len(c), generator=g) for c in children]
    ref = [torch.log_softmax(r, -1).tolist() for r in ref_logits]
    width = 4
    index = torch.tensor([c + c[:1] * (width - len(c)) for c in children])
    ref_t = torch.tensor([r + [float("-inf")] * (width - len(r)) for r in ref])
    direct = [sum(float(logp[i, t].exp()) * (float(logp[i, t]) - ref[i][k]) for k, t in enumerate(c))
              for i, c in enumerate(children)]
    assert kl_to_reference(logp.gather(1, index), ref_t).tolist() == pytest.approx(direct, abs=1e-6)
    same = torch.tensor([[float(logp[i, t]) for t in c] + [float("-inf")] * (width - len(c)) for i, c in enumerate(children)])
    assert kl_to_reference(logp.gather(1, index), same).abs().max() < 1e-6
    # as the update calls it: log-probs of the allowed entries only, -inf at the padding; the
    # padding must not turn the gradient into NaN
    narrow = logits.gather(1, index).requires_grad_()
    valid = torch.isfinite(ref_t)
    kl = kl_to_reference(torch.log_softmax(narrow.masked_fill(~valid, float("-inf")), -1), ref_t)
    assert kl.tolist() == pytest.approx(direct, abs=1e-6)
    kl.sum().backward()
    assert torch.isfinite(narrow.grad).all() and narrow.grad[~valid].abs().max() == 0


def test_group_rollouts_play_each_game_group_size_times_with_different_samples(tmp_path, easy_pool):
    cfg = config(tmp_path, "env.num_envs=8", "env.group_size=4", "ppo.advantage=rloo")
    curriculum = Curriculum(cfg)
    curriculum.load()
    games = curriculum.games(0).games
    assert len(games) == 8 and len(set(games)) == 2
    assert games[:4] == [games[0]] * 4 and games[4:] == [games[4]] * 4
    assert not set(games) & set(curriculum.eval_games)

    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty)
    module = PPOModule(cfg, policy, tokenizer)
    episodes, _ = play_games(module.player, games, cfg.env, Sampling(3.0, episode_seeds(cfg.seed, 0, games)))
    # episodes that all lose in as many steps tie in return: a bonus of its own on each episode's
    # last turn makes a group's returns differ, as a game's score can
    for i, e in enumerate(episodes):
        e.steps[-1] = replace(e.steps[-1], reward=e.steps[-1].reward + 0.1 * i)
    assert [e.game for e in episodes] == [str(g) for g in games]
    plays = [tuple(s.action.command for s in e.steps) for e in episodes]
    assert len(set(plays[:4])) > 1 or len(set(plays[4:])) > 1  # the same game, sampled differently

    counts = [sum(len(s.action.decisions) for s in e.steps) for e in episodes]
    advantages, _ = rollout_advantages(episodes, torch.zeros(sum(counts)), 0.99, 0.95, estimator="rloo", normalize=False)
    returns = [e.total_return for e in episodes]
    for i, adv in enumerate(advantages.split(counts)):  # each episode's decisions, in rollout order
        group = [returns[j] for j in range(len(episodes)) if episodes[j].game == episodes[i].game and j != i]
        expected = returns[i] - sum(group) / len(group)
        assert all(a == pytest.approx(expected) for a in adv.tolist())

    # GiGPO on the real group: a game's episodes all start from its opening state, so their first
    # turns share a step group (with any later turn back in that room with the same inventory), and
    # the first decision's step term compares the returns from those turns on (gamma = 1)
    gi, _ = rollout_advantages(episodes, torch.zeros(sum(counts)), 1.0, 0.95, estimator="gigpo", normalize=False)
    gr, _ = rollout_advantages(episodes, torch.zeros(sum(counts)), 1.0, 0.95, estimator="grpo", normalize=False)
    assert len({round(r, 6) for r in returns[:4]}) > 1  # else the step term would be 0 == 0
    opening = episodes[0].steps[0].observation
    assert all(e.steps[0].action.decisions and e.steps[0].observation == opening for e in episodes[:4])
    same = [sum(s.reward for s in e.steps[t:]) for e in episodes[:4] for t, s in enumerate(e.steps)
            if s.action.decisions and (s.observation.description, s.observation.inventory)
            == (opening.description, opening.inventory)]
    mean = sum(same) / len(same)
    std = (sum((x - mean) ** 2 for x in same) / (len(same) - 1)) ** 0.5
    first = [sum(counts[:i]) for i in range(4)]
    assert [float(gi[k] - gr[k]) for k in first] == pytest.approx([(r - mean) / (std + 1e-8) for r in returns[:4]],
                                                                  abs=1e-9)


@pytest.mark.parametrize("memory", ["none", "lora"])
def test_kl_to_the_reference_is_zero_at_the_first_update_and_grows_after_a_step(tmp_path, easy_pool, memory):
    cfg = config(tmp_path, f"memory={memory}", "ppo.kl_coef=0.5")
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty, memory=cfg.memory)
    module = PPOModule(cfg, policy, tokenizer)
    update = module.update
    games = easy_pool.games("train", 4)
    episodes, _ = play_games(module.player, games, cfg.env, Sampling(1.0, episode_seeds(0, 0, games)))
    data = update.prepare(episodes, 0)  # the reference's log-probs, fixed for the iteration
    n = float(data.rollout.count)
    first = data.steps[0][0]
    terms, _ = update.loss(first, data, n)
    assert abs(float(terms.kl_ref)) < 1e-6  # the policy is still the reference

    optimizer = torch.optim.SGD([q for q in module.policy.parameters() if q.requires_grad], lr=1.0)
    terms.loss.backward()
    optimizer.step()
    with torch.no_grad():
        after, _ = update.loss(first, data, n)
    assert float(after.kl_ref) > 1e-6
    # the reference itself did not move: swapped in again, it gives back the stored log-probs
    again_ref = update.reference_logprobs([[first]], data.rollout, data.targets.temperatures, data.prefix,
                                          data.coefs.explore)
    again_data = replace(data, targets=replace(data.targets, ref_logprobs=again_ref))
    with torch.no_grad():
        again, _ = update.loss(first, again_data, n)
    assert float(again.kl_ref) == pytest.approx(float(after.kl_ref), rel=1e-5)


@pytest.mark.parametrize("advantage", ["grpo", "gigpo"])
def test_a_group_baseline_run_trains_without_the_value_head(tmp_path, advantage):
    import textrl.cli.train as cli
    from tests.conftest import Snapshot, read_metrics

    snapshot = Snapshot()
    result = cli.train(config(tmp_path, "iterations=1", "env.group_size=2", f"ppo.advantage={advantage}", "ppo.kl_coef=0.1"),
                       callbacks=[snapshot])
    changed = snapshot.changed(result["module"])
    assert any(k.startswith("lm.") for k in changed) and not any(k.startswith("value_head.") for k in changed)
    row = next(r for r in read_metrics(tmp_path) if r.get("loss/policy"))
    assert row["policy/kl_ref"] != "" and not row.get("loss/value") and not row.get("value/explained_variance")


def test_group_baselines_need_groups():
    from textrl.config import ConfigError
    from tests.test_config import compose_train

    with pytest.raises(ConfigError, match="env.group_size=1 is not allowed: at least 2 with ppo.advantage=grpo"):
        compose_train(["ppo.advantage=grpo"])
    with pytest.raises(ConfigError, match="env.group_size=3 is not allowed: a divisor of env.num_envs"):
        compose_train(["env.group_size=3"])
