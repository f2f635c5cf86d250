"""Self-imitation (textrl/training/self_imitation.py): the memory of shortest wins, loop erasure on
real games, the cloning step on the real tiny model, and a run that remembers, clones and resumes."""

import random
from dataclasses import replace

import pytest
import torch

import textrl.cli.train as cli
import textrl.training.self_imitation as si
from textrl.config import SelfImitationConfig, load_model_config
from textrl.games.env import open_game
from textrl.games.pool import GamePool
from textrl.games.prompt import PromptBuilder
from textrl.policy.distribution import fork_logprobs
from textrl.policy.memory import make_optimizer
from textrl.policy.model import build_policy
from textrl.ppo.sequences import decision_forward, training_sequences
from textrl.ppo.update import PPOUpdate
from textrl.rollout import replay_commands
from tests.conftest import StopAfter, config, read_metrics, table
from tests.faulty_games import inject


@pytest.fixture(scope="module")
def setting(tiny):
    cfg = config("unused")
    prompts = PromptBuilder.for_env(tiny[1], cfg.env)
    return cfg, prompts, GamePool("easy").games("train", 6), tiny[1]


def medium_game(cfg, prompts):
    """A medium training game (quest length 3: easy walkthroughs are one command) whose walkthrough
    shows a new state at every turn, and that walkthrough."""
    for game in GamePool("medium").games("train", 8):
        path = walkthrough(game, cfg)
        states = [s.observation.state for s in played(game, path, cfg, prompts).steps]
        if len(path) >= 2 and len(set(states)) == len(states):
            return game, path
    raise AssertionError("no medium training game among the first 8 has such a walkthrough")


def played(game, commands, cfg, prompts):
    handle = open_game(game, cfg.env)
    try:
        return replay_commands(handle, prompts, commands)
    finally:
        handle.close()


def walkthrough(game, cfg):
    handle = open_game(game, cfg.env)
    try:
        handle.reset()
        return list(handle.walkthrough)
    finally:
        handle.close()


def test_a_win_with_turns_that_change_nothing_is_remembered_without_them(setting):
    cfg, prompts, _, tokenizer = setting
    imitation = si.SelfImitation(SelfImitationConfig(episodes=4), 0, tokenizer)
    game, path = medium_game(cfg, prompts)
    # "inventory" and "look" leave the room and the inventory as they were: a loop of length one each
    detour = ["inventory", "look", *path[:1], "inventory", *path[1:]]
    episode = played(game, detour, cfg, prompts)
    assert episode.won and episode.length == len(detour)  # every detour command was admissible and played
    assert si.loop_erased(episode) == path
    assert imitation.shortest(episode, cfg.env) == (path, 3)


def test_an_erased_list_that_no_longer_wins_falls_back_to_the_commands_played(setting):
    """The state a game shows is not the whole world: where the erasure cuts a command that mattered
    (here every state is made to look like the first, so that erasure keeps the last command alone),
    the replay does not win and the full list is remembered."""
    cfg, prompts, _, tokenizer = setting
    imitation = si.SelfImitation(SelfImitationConfig(episodes=4), 0, tokenizer)
    game, path = medium_game(cfg, prompts)
    episode = played(game, path, cfg, prompts)
    first = episode.steps[0].observation
    for step in episode.steps:
        step.observation = replace(step.observation, description=first.description, inventory=first.inventory)
    assert si.loop_erased(episode) == path[-1:]
    assert imitation.shortest(episode, cfg.env) == (path, 0)


def test_the_memory_keeps_each_games_shortest_win_and_forgets_the_least_recently_won():
    memory = si.WinMemory(size=2)
    memory.record("a", ["x", "y", "z"])
    memory.record("a", ["x", "y", "z", "w"])  # longer: the shorter stays
    assert memory.wins["a"] == ["x", "y", "z"]
    memory.record("b", ["q"])
    memory.record("a", ["y"])  # shorter: replaces it, and "a" is now the most recently won
    memory.record("c", ["r"])  # over the size: "b" goes
    assert memory.wins == {"a": ["y"], "c": ["r"]}
    copy = si.WinMemory(size=2)
    copy.load_state_dict(memory.state_dict())
    assert copy.wins == memory.wins
    draw = [memory.draw(random.Random(7), 5) for _ in range(2)]
    assert draw[0] == draw[1] and sorted(g for g, _ in draw[0]) == ["a", "c"]  # no repeats, at most what it holds
    memory.keep_only({"c"})
    assert memory.wins == {"c": ["r"]}


def test_a_remembered_game_that_faults_when_replayed_is_forgotten_and_the_rest_are_cloned(setting, monkeypatch):
    cfg, prompts, games, tokenizer = setting
    imitation = si.SelfImitation(SelfImitationConfig(episodes=4), 0, tokenizer)
    for game in games[:2]:
        imitation.memory.record(str(game), walkthrough(game, cfg))
    broken = str(games[0])

    def opening(game, env):  # the real game; the first one's engine raises at its first step
        handle = open_game(game, env)
        if str(game) == broken:
            inject(handle, 1, "engine_raises")
        return handle

    monkeypatch.setattr(si, "open_game", opening)
    cloned = []

    def imitate(episodes):
        cloned.extend(episodes)
        return {}

    figures = imitation.run([], 0, cfg.env, games, imitate)
    assert [e.game for e in cloned] == [str(games[1])] and cloned[0].won
    assert list(imitation.memory.wins) == [str(games[1])]
    assert figures["imitation/episodes"] == 1 and figures["imitation/games"] == 1


def cloned_logprob(policy, episodes, pad_id) -> float:
    with torch.no_grad():
        out = decision_forward(policy, training_sequences(episodes).sequences, pad_id)
        return float(fork_logprobs(out.logits, out.valid).gather(1, out.chosen[:, None]).mean())


def test_imitate_raises_the_cloned_commands_probability_and_leaves_the_value_head_alone(setting):
    cfg, prompts, games, _ = setting
    torch.manual_seed(0)
    policy, tokenizer = build_policy(load_model_config("tiny"))
    episodes = [played(g, walkthrough(g, cfg), cfg, prompts) for g in games[:4]]
    assert all(e.won for e in episodes)
    update = PPOUpdate(policy, cfg.ppo, tokenizer.pad_token_id, cfg.seed)
    # weight decay: AdamW would move a value head whose gradient is zero rather than None
    optimizer = make_optimizer([q for q in policy.lm.parameters() if q.requires_grad],
                               list(policy.value_head.parameters()), cfg.memory, 3e-3, 1e-3, 0.1)
    value_head = {k: v.clone() for k, v in policy.value_head.state_dict().items()}
    before = cloned_logprob(policy, episodes, tokenizer.pad_token_id)
    for iteration in range(4):
        figures = update.imitate(episodes, iteration, optimizer)
    after = cloned_logprob(policy, episodes, tokenizer.pad_token_id)
    assert after > before + 0.1, (before, after)
    assert figures["imitation/decisions"] == sum(len(s.action.decisions) for e in episodes for s in e.steps)
    assert figures["imitation/loss"] > 0
    assert all(torch.equal(v, policy.value_head.state_dict()[k]) for k, v in value_head.items())


def test_a_run_with_self_imitation_remembers_wins_clones_them_and_resumes_exactly(tmp_path):
    # near-uniform rollouts win some easy games even with the untrained tiny model
    common = ["iterations=3", "eval.every=3", "eval.before_training=false", "ppo.explore=0.9",
              "self_imitation.episodes=3", "env.num_envs=6"]
    straight = cli.train(config(tmp_path / "straight", *common))
    rows = [r for r in read_metrics(tmp_path / "straight") if r.get("imitation/games")]
    assert len(rows) == 3
    won = [float(r["rollout/win_rate"]) for r in rows]
    remembered = [float(r["imitation/games"]) for r in rows]
    assert won[0] > 0 and remembered[0] >= 1 and remembered == sorted(remembered)
    assert all(float(r["imitation/decisions"]) > 0 and float(r["imitation/loss"]) > 0 for r in rows)
    memory = straight["module"].imitation.memory.wins
    pool = {str(g) for g in straight["trainer"].datamodule.curriculum.train_games}
    assert memory and set(memory) <= pool

    cli.train(config(tmp_path / "split", *common), callbacks=[StopAfter(1)])
    last = tmp_path / "split" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=False)["textrl"]["self_imitation"]
    assert saved["wins"]  # the memory travels with the checkpoint
    resumed = cli.train(config(tmp_path / "split", *common, f"ckpt_path={last}"))
    assert list(resumed["module"].imitation.memory.wins.items()) == list(memory.items())  # the order too
    a, b = straight["module"].policy.state_dict(), resumed["module"].policy.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert table(tmp_path / "straight") == table(tmp_path / "split")
    keys = ["imitation/games", "imitation/episodes", "imitation/decisions", "imitation/loss"]

    def cloned(run):
        return [[round(float(r[k]), 5) for k in keys] for r in read_metrics(run) if r.get("imitation/games")]

    assert cloned(tmp_path / "straight") == cloned(tmp_path / "split")


@pytest.mark.parametrize("key,value", [("episodes", "-1"), ("games", "0")])
def test_bad_self_imitation_settings_are_refused_naming_the_key(tmp_path, key, value):
    with pytest.raises(cli.ConfigError, match=rf"self_imitation\.{key}"):
        config(tmp_path, f"self_imitation.{key}={value}")


def test_a_game_the_memory_names_outside_the_runs_pool_is_never_opened(setting, monkeypatch):
    """A checkpoint's memory names files: only games of the run's own training pool are replayed."""
    cfg, prompts, games, tokenizer = setting
    imitation = si.SelfImitation(SelfImitationConfig(episodes=4), 0, tokenizer)
    foreign = str(games[0].parent.parent / "elsewhere" / games[0].name)
    imitation.load_state_dict({"wins": [[foreign, ["look"]], [str(games[1]), walkthrough(games[1], cfg)]]})
    opened = []

    def spying(game, env):  # the real game is still opened
        opened.append(str(game))
        return open_game(game, env)

    monkeypatch.setattr(si, "open_game", spying)
    imitation.run([], 0, cfg.env, games, lambda episodes: {})
    assert opened == [str(games[1])] and list(imitation.memory.wins) == [str(games[1])]
