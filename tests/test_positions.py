"""A model's position limit and the prompt budget (issue 31, item 2).

GPT-2 learns 1,024 positions and env.max_prompt_tokens is 1,536 (2,048 on hard and tw_cooking): a
prompt past the table indexes out of it (an IndexError on a CPU, a device-side assert on a GPU).
Here a GPT-2-architecture model with random weights and 384 positions (cheap, and easy prompts pass
384 tokens by the third turn) trains and is evaluated on real easy and medium games: the prompt
budget is capped to the positions, with one log line, where the model and the env meet.
"""

import json
import logging
from dataclasses import replace

import pytest
from hydra import compose, initialize_config_dir

import textrl.cli.evaluate as evaluate_cli
import textrl.cli.train as cli
from tests.conftest import SMALL, read_metrics
from textrl.config import CONF_DIR, EnvConfig, load_model_config, to_train_config
from textrl.errors import ConfigError
from textrl.policy.checkpoint import load_checkpoint_policy
from textrl.policy.model import build_policy

POSITIONS = 384
GPT2 = ["model=gpt2", "model.source=random", "model.value_hidden=32", "model.architecture.n_layer=2",
        "model.architecture.n_embd=64", "model.architecture.n_head=4"]


def gpt2_config(tmp_path, positions, *overrides):
    """The small training config (tests/conftest.py) with a random 2-layer GPT-2 of ``positions``."""
    small = [o for o in SMALL if not o.startswith("model=")]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"output_dir={tmp_path}", *small, "memory=none", *GPT2,
                                          f"model.architecture.n_positions={positions}", *overrides])
    return to_train_config(cfg)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One iteration of PPO (and the evaluation after it) with the 384-position GPT-2 on easy games,
    whose prompts reach about 1,000 tokens within the 8 steps of an episode; its log records."""
    run = tmp_path_factory.mktemp("gpt2")
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("textrl")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        result = cli.train(gpt2_config(run, POSITIONS, "iterations=1", "eval.every=1"))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return result, [r.getMessage() for r in records]


def test_a_gpt2_model_trains_and_evaluates_on_prompts_longer_than_its_positions(trained):
    result, messages = trained
    assert result["trainer"].current_epoch == 1 and result["metrics"]["eval/games"] == 4
    # capped to the positions less the command's room, said once
    budget = POSITIONS - 64
    caps = [m for m in messages if "max_prompt_tokens 1536 ->" in m]
    assert caps == [f"env easy: max_prompt_tokens 1536 -> {budget}, within gpt2's {POSITIONS} positions "
                    f"(64 left for the command)"]
    # the checkpoint keeps the capped budget: textrl-eval and textrl-play read it back
    _, _, cfg = load_checkpoint_policy(result["last"])
    assert cfg.env.max_prompt_tokens == budget
    # episodes long enough that the prompts passed 384 tokens (by the third turn on easy)
    train_row = next(r for r in read_metrics(result["run_dir"]) if r.get("loss/policy"))
    assert float(train_row["rollout/episode_len"]) > 3


def test_textrl_eval_caps_another_settings_budget_to_the_checkpoints_positions(trained, tmp_path, caplog):
    """A checkpoint plays medium with its own prompt settings and medium's budget (1,536): capped
    by textrl-eval, and played through."""
    result, _ = trained
    caplog.set_level(logging.INFO)
    out = tmp_path / "eval"
    assert evaluate_cli.main(["--checkpoint", result["last"], "--env", "medium", "--games", "2", "--batch", "2",
                              "--max-steps", "8", "--out", str(out)]) == 0
    summary = json.loads((out / "results.json").read_text())
    assert summary["env"] == "medium" and summary["games"] == 2 and not summary["aborted"]
    assert max(g["steps"] for g in summary["per_game"]) > 3  # prompts past 384 tokens
    assert f"env medium: max_prompt_tokens 1536 -> {POSITIONS - 64}, within gpt2's {POSITIONS}" in caplog.text


def test_fit_to_positions_caps_with_one_log_line_and_leaves_room_for_the_command(caplog):
    from textrl.config import COMMAND_ROOM, fit_to_positions

    caplog.set_level(logging.INFO, logger="textrl.config")
    env = EnvConfig(name="hard", max_prompt_tokens=2048)
    capped = fit_to_positions(env, 1024, "gpt2")
    assert capped.max_prompt_tokens == 1024 - COMMAND_ROOM == 960
    assert capped == replace(env, max_prompt_tokens=960)  # nothing else changes
    assert [r.getMessage() for r in caplog.records] == [
        "env hard: max_prompt_tokens 2048 -> 960, within gpt2's 1024 positions (64 left for the command)"]
    caplog.clear()
    assert fit_to_positions(env, 8192) is env  # within the positions (SmolLM2: 8,192): unchanged, silent
    assert fit_to_positions(env, None) is env  # a model that names no limit
    assert fit_to_positions(replace(env, max_prompt_tokens=960), 1024).max_prompt_tokens == 960  # exactly fits
    assert not caplog.records


def test_a_model_too_small_for_the_least_prompt_is_refused_before_training(tmp_path):
    from textrl.config import fit_to_positions

    with pytest.raises(ConfigError, match="150 positions: 86 for the prompt .* under the least "
                                          r"env.max_prompt_tokens \(128\); use a model with at least 192"):
        fit_to_positions(EnvConfig(), 150, "tiny-gpt2")
    assert fit_to_positions(EnvConfig(), 192).max_prompt_tokens == 128  # the least that works
    with pytest.raises(ConfigError, match="gpt2 has 160 positions"):
        cli.train(gpt2_config(tmp_path, 160, "iterations=1"))
    assert not (tmp_path / "checkpoints").exists()


def test_the_position_limit_is_the_models_configured_positions():
    gpt2, _ = build_policy(load_model_config("gpt2", source="random", value_hidden=8, architecture={
        "model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 300}))
    assert gpt2.position_limit == 300  # GPT-2's n_positions, read as max_position_embeddings
    tiny, _ = build_policy(load_model_config("tiny"))
    assert tiny.position_limit == 4096


def test_a_command_longer_than_the_room_left_for_it_is_refused(tiny):
    from textrl.games.env import Observation
    from textrl.config import COMMAND_ROOM
    from textrl.games.prompt import PromptBuilder, PromptTooLongError

    prompts = PromptBuilder(tiny[1])
    obs = Observation("win", "a room", "nothing", "", ["go north", "take " + " and ".join(["the blue key"] * 20)],
                      0, 1, False, False)
    with pytest.raises(PromptTooLongError, match=f"is [0-9]+ tokens with its end token, over the {COMMAND_ROOM}"):
        prompts.trie(obs)
    assert prompts.trie(replace(obs, admissible_commands=["go north", "take the blue key"])).commands
