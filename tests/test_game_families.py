"""Games beyond the presets: custom TextWorld settings and TextWorld's challenge families, through
textrl's own env, pool, decoder and textrl-eval. Real generated games, the real tiny model."""

from __future__ import annotations

import json
import shutil

import pytest
from omegaconf import OmegaConf

from textrl.cli.evaluate import main as eval_main
from textrl.config import load_env_config
from textrl.errors import ConfigError
from textrl.games.env import open_game
from textrl.games.express import JAVA_MISSING, java_available
from textrl.games.pool import GamePool, GameSpec
from textrl.policy.checkpoint import checkpoint_config
from textrl.policy.decoding import ConstrainedDecoder
from textrl.rollout import Sampling, decode_episodes

FAMILIES = ["tw_simple", "tw_coin", "tw_treasure", "tw_cooking"]
# TextWorldExpress runs in Java: on a machine without it these tests say how to install it
needs_java = pytest.mark.skipif(not java_available(), reason=JAVA_MISSING)
EXPRESS = [pytest.param(g, marks=needs_java) for g in ("twx_cookingworld", "twx_coin", "twx_twc", "twx_mapreader",
                                                         "twx_arithmetic", "twx_sorting", "twx_simonsays",
                                                         "twx_peckingorder")]


def games_of(option: str, split: str = "eval", n: int = 1, **changes):
    env = load_env_config(option)
    for key, value in changes.items():
        setattr(env, key, value)
    return env, GamePool(GameSpec.from_env(env)).games(split, n)


@pytest.mark.parametrize("option", FAMILIES + EXPRESS + ["custom"])
def test_walkthrough_wins_through_textrl_env(option):
    env, (path,) = games_of(option)
    game = open_game(path, env)
    obs = game.reset()
    assert game.walkthrough and obs.objective is not None
    total = 0.0
    for i, command in enumerate(game.walkthrough):
        assert command in game.observation.admissible_commands
        before = game.observation.score
        result = game.step(command)
        last = i == len(game.walkthrough) - 1
        assert result.reward == pytest.approx(result.observation.score - before + (env.win_bonus if last else 0)
                                              - env.step_penalty)
        assert result.terminated == last
        total += result.reward
    assert game.observation.won and not game.observation.lost
    assert total == pytest.approx(game.observation.max_score + env.win_bonus - env.step_penalty * len(game.walkthrough))


def test_losing_a_cooking_game_ends_it_and_costs_the_loss_penalty_and_the_unplayed_steps():
    env, (path,) = games_of("tw_cooking", loss_penalty=0.7)
    game = open_game(path, env)
    game.reset()
    walkthrough = game.walkthrough
    take = next(i for i, c in enumerate(walkthrough) if c.startswith("take "))
    total = 0.0
    for command in walkthrough[: take + 1]:
        total += game.step(command).reward
    ingredient = walkthrough[take].removeprefix("take ").split(" from ")[0]
    before = game.observation.score
    result = game.step(f"eat {ingredient}")  # the recipe's ingredient, eaten raw: the game is lost
    total += result.reward
    assert result.observation.lost and result.terminated and not result.observation.won
    unplayed = env.max_steps - (take + 2)
    assert unplayed > 0
    assert result.reward == pytest.approx(result.observation.score - before - 0.7 - env.step_penalty * (1 + unplayed))
    # the episode costs the step penalty of a game played to the step limit, and the loss penalty on top:
    # a loss ranks below every episode that is not lost
    assert total == pytest.approx(result.observation.score - 0.7 - env.step_penalty * env.max_steps)
    assert "You lost" not in result.observation.feedback  # the end-of-game banner is not an observation


@pytest.mark.parametrize("option", FAMILIES + EXPRESS)
def test_only_admissible_commands_and_disjoint_splits(option, tiny):
    policy, tokenizer = tiny
    env, train = games_of(option, "train", 2, max_steps=6)
    _, evals = games_of(option, "eval", 2)
    assert not set(train) & set(evals)
    assert {p.read_bytes() for p in train}.isdisjoint({p.read_bytes() for p in evals})
    from textrl.games.prompt import PromptBuilder

    prompts = PromptBuilder.for_env(tokenizer, env, max_prompt_tokens=4096)
    episodes, _ = decode_episodes([open_game(p, env) for p in evals], [ConstrainedDecoder(policy)],
                                  prompts, Sampling(1.0, [1, 2]))
    assert all(e.steps for e in episodes)
    assert all(s.action.command in s.observation.admissible_commands for e in episodes for s in e.steps)


def test_each_distinct_setting_has_its_own_cache_entry(tmp_path):
    keys = {
        "easy": GameSpec.from_env(load_env_config("easy")).key,
        "custom rooms=3": GamePool(GameSpec.from_env(OmegaConf.to_object(OmegaConf.merge(
            OmegaConf.structured(load_env_config("custom")), {"rooms": 3}))), cache_dir=tmp_path).spec.key,
        **{f: GameSpec.from_env(load_env_config(f)).key for f in FAMILIES},
    }
    coin = load_env_config("tw_coin")
    coin.settings = {"level": 9}
    keys["tw_coin level 9"] = GameSpec.from_env(coin).key
    assert len(set(keys.values())) == len(keys), keys
    # the family's defaults are part of the key: leaving one out names the same games
    cooking = load_env_config("tw_cooking")
    explicit = GameSpec.from_env(cooking).key
    cooking.settings = {k: v for k, v in cooking.settings.items() if k not in {"recipe", "cook"}}
    assert GameSpec.from_env(cooking).key == explicit


def test_cooking_held_out_games_take_foods_and_preparations_no_training_game_has():
    """env.eval_settings: tw_cooking's training games made with split=train, its held-out games with
    split=valid, whose foods and preparations of foods are those TextWorld keeps out of train."""
    from textworld.challenges.tw_cooking.cooking import FOOD_PREPARATIONS_SPLITS

    train_preparations = {(food, prep) for food, preps in FOOD_PREPARATIONS_SPLITS["train"].items() for prep in preps}
    by_split = {"settings": {**load_env_config("tw_cooking").settings, "split": "train"},
                "eval_settings": {"split": "valid"}}
    for split, made_with, in_train in (("train", "train", True), ("eval", "valid", False)):
        _, paths = games_of("tw_cooking", split, 4, **by_split)
        for path in paths:
            meta = json.loads(path.with_suffix(".json").read_text())["metadata"]
            assert meta["settings"]["split"] == made_with
            assert all(((food, (cook, cut)) in train_preparations) == in_train for food, cook, cut in meta["ingredients"])
    cooking = load_env_config("tw_cooking")
    for key, value in by_split.items():
        setattr(cooking, key, value)
    spec = GameSpec.from_env(cooking)
    assert dict(spec.eval_settings) == {"split": "valid"} and spec.key.endswith("-splittrain-take1-eval-splitvalid-tw1.7.0")
    same = load_env_config("tw_cooking")
    same.eval_settings = {"split": None, "go": 1}  # what equals the training settings changes nothing
    assert GameSpec.from_env(same).eval_settings == () and "-eval-" not in GameSpec.from_env(same).key


@pytest.mark.parametrize("option", ["easy", pytest.param("twx_cookingworld", marks=needs_java)])
def test_eval_settings_are_only_for_the_challenge_families(option):
    env = load_env_config(option)
    env.eval_settings = {"split": "valid"}
    with pytest.raises(ConfigError, match=f"env.eval_settings=.* is not allowed with env.game={env.game}"):
        GameSpec.from_env(env)
    cooking = load_env_config("tw_cooking")
    cooking.eval_settings = {"split": "dev"}  # checked by the family's own parser, as env.settings
    with pytest.raises(ConfigError, match="invalid choice: 'dev'"):
        GameSpec.from_env(cooking)


def test_challenge_settings_are_checked_by_the_family(tmp_path):
    coin = load_env_config("tw_coin")
    coin.settings = {"level": 3, "levl": 3}
    with pytest.raises(ConfigError, match=r"env.settings of tw-coin_collector: .*--levl.*--level LEVEL"):
        GameSpec.from_env(coin)
    cooking = load_env_config("tw_cooking")
    cooking.settings = {"go": 5}
    with pytest.raises(ConfigError, match="invalid choice: 5"):
        GameSpec.from_env(cooking)
    cooking = load_env_config("tw_cooking")
    cooking.rooms = 3
    with pytest.raises(ConfigError, match="env.rooms=3 is not allowed with env.game=tw-cooking"):
        GameSpec.from_env(cooking)


def test_eval_plays_a_directory_of_game_files(tmp_path, capsys):
    _, paths = games_of("tw_treasure", "eval", 2)
    folder = tmp_path / "mine"
    for k, path in enumerate(paths):  # user-named files, each with TextWorld's .json beside it
        (folder / f"sub{k}").mkdir(parents=True)
        shutil.copy(path, folder / f"sub{k}" / f"quest{k}.z8")
        shutil.copy(path.with_suffix(".json"), folder / f"sub{k}" / f"quest{k}.json")
    out = tmp_path / "out"
    assert eval_main(["--random", "--games", str(folder), "--max-steps", "5", "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["env"] == "files" and result["max_steps"] == 5
    assert [g["game"] for g in result["per_game"]] == ["quest0.z8", "quest1.z8"]
    assert all(g["steps"] <= 5 for g in result["per_game"])
    assert "## quest0.z8:" in (out / "transcripts.md").read_text()
    (folder / "sub0" / "quest0.json").unlink()
    with pytest.raises(SystemExit, match="quest0.json is missing or corrupt"):
        eval_main(["--random", "--games", str(folder)])


def test_several_env_options_give_a_generalization_table(tmp_path):
    out = tmp_path / "gen"
    assert eval_main(["--random", "--env", "easy", "tw_coin", "--games", "2", "--out", str(out)]) == 0
    table = (out / "generalization.md").read_text()
    assert "| policy (trained on) | easy | tw_coin |" in table and "| random (-) |" in table
    cells = json.loads((out / "generalization.json").read_text())["results"]
    assert [c["env"] for c in cells] == ["easy", "tw_coin"]
    for c in cells:
        played = json.loads((out / f"random-{c['env']}" / "results.json").read_text())
        assert played["games"] == 2 and played["win_rate"] == c["win_rate"]


def test_checkpoints_written_before_env_options_load_as_the_same_games():
    legacy = {"textrl": {"config": {"output_dir": "x", "env": {"difficulty": "medium", "max_steps": None,
                                                               "goal_last": True}}}}
    env = checkpoint_config(legacy).env
    medium = load_env_config("medium")
    assert (env.name, env.rooms, env.quest_length, env.max_steps, env.goal_last) == ("medium", 3, 3, 32, True)
    assert GameSpec.from_env(env).key == GameSpec.from_env(medium).key
    # from before env.block_repeats: played as trained, every command offered
    assert not env.block_repeats
    written = {"textrl": {"config": {"output_dir": "x", "env": {"name": "easy", "block_repeats": True}}}}
    assert checkpoint_config(written).env.block_repeats


@needs_java
def test_express_games_are_the_engine_folds_and_need_java(monkeypatch):
    from textrl.games.express import read_descriptor

    env, train = games_of("twx_coin", "train", 3)
    _, evals = games_of("twx_coin", "eval", 3)
    folds = [read_descriptor(p) for p in train + evals]
    assert [d["fold"] for d in folds] == ["train"] * 3 + ["dev"] * 3
    assert len({(d["fold"], d["seed"]) for d in folds}) == 6
    assert all(sorted(d["params"].split(",")) == ["includeDoors=0", "limitInventorySize=0", "numDistractorItems=0", "numLocations=3"] for d in folds)
    bad = load_env_config("twx_coin")
    bad.settings = {"numLocations": 300}
    with pytest.raises(ConfigError, match="Number of locations must be less than or equal to 11"):
        GameSpec.from_env(bad)
    monkeypatch.setenv("PATH", "/nonexistent")  # a machine without Java: said at start, with the fix
    with pytest.raises(ConfigError, match=r"env.game=twx-coin: TextWorldExpress runs its game engine in Java.*apt-get install"):
        GameSpec.from_env(load_env_config("twx_coin"))


@needs_java
@pytest.mark.parametrize("option, shown", [("twx_simonsays", "Simon says"), ("twx_coin", "You are in the"),
                                           ("twx_arithmetic", "math problem")])
def test_the_opening_observation_is_shown(option, shown, tiny):
    """What the engine says at the start is in the first prompt (Simon Says: the first order)."""
    from textrl.games.prompt import PromptBuilder, observation_text

    env, (path,) = games_of(option)
    game = open_game(path, env)
    obs = game.reset()
    assert shown in observation_text(obs)
    prompts = PromptBuilder.for_env(tiny[1], env, max_prompt_tokens=4096)
    assert shown in tiny[1].decode(prompts.build(obs, game.history))


@needs_java
@pytest.mark.parametrize("keep", [["read"], []])
def test_keep_answers_keeps_the_recipe_in_the_prompt_after_the_history_is_cut(keep, tiny):
    """CookingWorld's recipe is the answer to `read cookbook`, the third command: eight steps on, a
    history of 4 turns has been cut twice. With env.keep_answers=[read] the recipe is still in the
    prompt the policy decides from; without it, it is gone."""
    from textrl.games.prompt import PromptBuilder

    env, (path,) = games_of("twx_cookingworld", history_len=4, keep_answers=keep)
    game = open_game(path, env)
    game.reset()
    walkthrough = game.walkthrough
    read = walkthrough.index("read cookbook")
    recipe = None
    for command in walkthrough[: read + 9]:
        game.step(command)
        recipe = recipe or (game.observation.feedback if command == "read cookbook" else None)
    assert recipe and "Ingredients:" in recipe and len(game.history) <= env.history_len
    prompt = PromptBuilder.for_env(tiny[1], env).build(game.observation, game.history)
    assert (recipe in tiny[1].decode(prompt)) == bool(keep)
    game.close()
