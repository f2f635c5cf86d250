"""ppo.value_steps_left, the time-aware value: the value head adds a learned value per number of
steps left, and the step limit ends an episode. Checked on the rule (GAE with the limit as an
end), the head's table, a real rollout and update of the tiny model on real games (no bootstrap
pass; old values = the state's part + the table; the table learns; the first ratio is 1), a
training run's checkpoint, and the settings it refuses."""

import pytest
import torch

import textrl.cli.train as cli
from tests.conftest import config
from textrl.config import ConfigError, validate
from textrl.policy.checkpoint import load_checkpoint_policy
from textrl.policy.decoding import Action, ConstrainedDecoder, Decision
from textrl.policy.memory import make_optimizer
from textrl.policy.model import ValueHead, build_policy, steps_left_limit
from textrl.ppo.advantages import episode_gae, rollout_advantages
from textrl.ppo.sequences import training_sequences
from textrl.ppo.update import PPOUpdate
from textrl.rollout import Episode, Player, Sampling, Step, episode_seeds, play_games


def turn(reward, value, truncated=False, terminated=False):
    decision = Decision(index=0, allowed=[1, 2], token=1, logprob=-0.5, value=value)
    return Step(None, [], Action("cmd", [1, 1], [decision], 1.0), reward, terminated, truncated, "")


def test_with_the_limit_as_an_end_a_cut_episode_is_valued_as_one_that_ended():
    values = torch.tensor([0.2, -0.3, 0.1], dtype=torch.float64)
    cut = Episode("g", [turn(-0.1, 0.2), turn(-0.1, -0.3), turn(-0.1, 0.1, truncated=True)])  # no bootstrap value
    ended = Episode("g", [turn(-0.1, 0.2), turn(-0.1, -0.3), turn(-0.1, 0.1, terminated=True)])
    adv, ret = episode_gae(cut, values, 0.9, 0.8, limit_ends=True)
    ended_adv, ended_ret = episode_gae(ended, values, 0.9, 0.8)
    assert ret.tolist() == pytest.approx(ended_ret.tolist()) and adv.tolist() == pytest.approx(ended_adv.tolist())
    assert ret[-1] == pytest.approx(-0.1)  # nothing after the last step
    with pytest.raises(ValueError, match="bootstrap"):  # without the rule the cut still needs its bootstrap
        episode_gae(cut, values, 0.9, 0.8)
    # and a bootstrap value, if an episode has one, is not read
    cut.bootstrap_value = 5.0
    assert episode_gae(cut, values, 0.9, 0.8, limit_ends=True)[1].tolist() == pytest.approx(ended_ret.tolist())


def test_the_table_starts_at_the_return_of_steps_that_earn_the_step_penalty_alone():
    head = ValueHead(8, 4, -0.1, (4, 0.9))
    assert head.steps_left.tolist() == pytest.approx([0.0, -0.1, -0.19, -0.271, -0.3439])
    assert head.net[2].bias.item() == 0.0  # the table holds the constant
    assert head.of_steps_left(torch.tensor([4, 1])).tolist() == pytest.approx([-0.3439, -0.1])
    plain = ValueHead(8, 4, -0.1)
    assert plain.steps_left is None and plain.net[2].bias.item() == pytest.approx(-0.1)


def test_an_update_adds_the_table_to_the_old_values_and_trains_it(tmp_path, easy_pool):
    """4 real episodes of 4 steps (easy games: most are cut by the limit)."""
    cfg = config(tmp_path, "env.max_steps=4", "ppo.grad_accum=1", "ppo.value_steps_left=true")
    torch.manual_seed(0)
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty, value_limit=steps_left_limit(cfg))
    player = Player(policy, tokenizer, [ConstrainedDecoder(policy, batched=False) for _ in range(2)])
    games = easy_pool.games("train", 4)
    episodes, _ = play_games(player, games, cfg.env, Sampling(1.0, episode_seeds(0, 0, games)))
    cut = [e for e in episodes if e.truncated]
    assert cut and all(e.bootstrap_value is None for e in cut)  # no pass to value the cut states

    update = PPOUpdate(policy, cfg.ppo, tokenizer.pad_token_id, cfg.seed)
    data = update.prepare(episodes, 0)
    rollout = training_sequences(episodes)
    table = policy.value_head.steps_left.detach().clone()
    expected = rollout.values + table[4 - rollout.turns]
    assert data.targets.steps_left.tolist() == (4 - rollout.turns).tolist()
    assert data.targets.old_values.tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    adv, ret = rollout_advantages(episodes, expected.double(), cfg.ppo.gamma, cfg.ppo.lam, limit_ends=True)
    assert data.targets.returns.tolist() == pytest.approx(ret.tolist(), abs=1e-5)

    optimizer = make_optimizer([q for q in policy.lm.parameters() if q.requires_grad],
                               list(policy.value_head.parameters()), cfg.memory, cfg.ppo.lr_lm, cfg.ppo.lr_value, 0.0)
    policy.train()
    stats = update.run(episodes, 0, optimizer)
    metrics = stats.metrics()
    assert metrics["policy/first_logratio_max"] < 1e-4  # the update's forward agrees with the rollout's
    seen = sorted(set((4 - rollout.turns).tolist()))
    moved = (policy.value_head.steps_left.detach() - table).abs()
    assert all(float(moved[k]) > 0 for k in seen)  # the value loss reaches every entry played
    assert float(moved[0]) == 0.0  # no decision has no step left

    # the same episodes under a head built for a longer limit: every entry read would be off by 2
    longer = config(tmp_path, "env.max_steps=6", "ppo.value_steps_left=true")
    policy6, _ = build_policy(longer.model, longer.env.step_penalty, value_limit=steps_left_limit(longer))
    with pytest.raises(ValueError, match=r"was cut by a step limit at 4 steps, not at the value head's 6"):
        PPOUpdate(policy6, longer.ppo, tokenizer.pad_token_id, longer.seed).prepare(episodes, 0)


def test_a_run_with_it_writes_and_loads_its_table_and_a_run_without_it_refuses_its_weights(tmp_path):
    result = cli.train(config(tmp_path / "first", "iterations=1", "eval.every=1", "ppo.value_steps_left=true"))
    trained = result["module"].policy.value_head.steps_left.detach()
    policy, _, cfg = load_checkpoint_policy(result["last"])
    assert cfg.ppo.value_steps_left and policy.value_head.steps_left.tolist() == pytest.approx(trained.tolist())
    assert len(trained) == cfg.env.max_steps + 1
    # a value head of another shape is named before anything is built, by model.init_from and resume alike
    with pytest.raises(cli.CheckpointError, match="with a value per step left of 8 steps; this run's has without"):
        cli.train(config(tmp_path / "second", f"model.init_from={result['last']}"))
    with pytest.raises(cli.CheckpointError, match="of 8 steps; this run's has with a value per step left of 6"):
        cli.train(config(tmp_path / "third", "ppo.value_steps_left=true", "env.max_steps=6",
                         f"ckpt_path={result['last']}"))


def test_an_update_refuses_a_value_head_built_for_the_other_setting(tmp_path):
    cfg = config(tmp_path, "ppo.value_steps_left=true")
    plain, tokenizer = build_policy(cfg.model, cfg.env.step_penalty)
    with pytest.raises(ValueError, match="ppo.value_steps_left=True, but the policy's value head was built without"):
        PPOUpdate(plain, cfg.ppo, tokenizer.pad_token_id, cfg.seed)


@pytest.mark.parametrize("overrides, named", [
    (["ppo.advantage=grpo", "env.group_size=2"], "ppo.advantage=grpo"),
    (["curriculum.stages=[easy,medium]"], "curriculum stages"),
])
def test_settings_without_one_step_limit_or_a_value_head_are_refused(tmp_path, overrides, named):
    with pytest.raises(ConfigError, match=f"ppo.value_steps_left=True is not allowed.*{named}"):
        validate(config(tmp_path, "ppo.value_steps_left=true", *overrides))
