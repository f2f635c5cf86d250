"""Every option of every config group composes; bad values fail at start, naming key, value and rule."""

import json
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

import textrl.cli.train  # noqa: F401  (registers the schemas)
from textrl.config import CONF_DIR, TrainConfig, check_renamed_options, resolve, to_train_config, validate
from textrl.errors import ConfigError
from textrl.games.express import java_available
from textrl.games.pool import check_games
from textrl.policy.checkpoint import removed_options_on, without_removed_options

ROOT = CONF_DIR.parent
CUDA_ONLY = {"fp16", "lowmem"}
GROUPS = ["env", "model", "memory", "ppo", "logger", "trainer", "experiment", "curriculum", "sweep"]


def compose_train(overrides=()):
    """The config ``python train.py <overrides>`` starts with, checked as ``train()`` checks it."""
    check_renamed_options(list(overrides))  # as the entry refuses them, before Hydra composes
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = to_train_config(compose("train", overrides=["output_dir=/tmp/unused", *overrides]))
    check_games(cfg)
    return cfg


def options(group):
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def test_defaults_are_easy_smollm2_csv():
    cfg = compose_train()
    assert isinstance(cfg, TrainConfig)
    assert (cfg.env.name, cfg.model.name, cfg.logger.name, cfg.memory.name) == ("easy", "smollm2", "csv", "auto")
    assert cfg.env.goal_last and not cfg.env.list_commands  # the prompt the easy ablation chose


def test_every_setting_plays_the_game_as_it_is_unless_its_name_says_the_rule():
    """The fewest-played rule changes which commands the game offers: the default run, every env
    option and every experiment but one named for it play without it, so their figures are the game's."""
    assert not TrainConfig().env.block_repeats and not compose_train().env.block_repeats
    for option in options("env"):
        assert not compose_train([f"env={option}"]).env.block_repeats, option
    for experiment in options("experiment"):
        assert compose_train([f"experiment={experiment}"]).env.block_repeats == ("_rule" in experiment), experiment


def recorded_configs(result_file: str):
    """The configs bench/learn.py recorded for a result file's seeds (without the keys seeds differ in,
    and without the options removed since, each of which the runs had off)."""
    measured = json.loads((ROOT / "bench/results" / result_file).read_text())
    recorded = [{k: v for k, v in run["resolved"].items() if k != "curriculum_replay_without_stages"}
                for run in measured["runs"]]
    assert not [on for config in recorded for on in removed_options_on(config)], result_file
    recorded = [without_inert_keys(without_removed_options(config)) for config in recorded]
    for config in recorded:  # keys added since, at the value that plays as the runs did
        config["eval"].setdefault("temperature", None)  # no sampled evaluation beside greedy
        if config["warm_start"]["steps"]:
            config["warm_start"].setdefault("source", "walkthrough")  # the walkthroughs cloned
        # the old default's 4 sequences an optimizer step, 1 per forward: the same steps over the same
        # sequences as the new default's 4 in one packed forward (test_training.py pins that the split
        # leaves a step's gradient as it is)
        if (config["ppo"]["minibatch_size"], config["ppo"]["grad_accum"]) == (1, 4):
            config["ppo"].update(minibatch_size=4, grad_accum=1)
    return recorded


def without_inert_keys(config: dict) -> dict:
    """Keys that play no part in a run, so that a default of theirs changing since leaves the run as it
    was: with ``warm_start.steps=0`` (RL alone) no walkthrough is replayed or generated, so the warm
    start's other keys, and cloning walkthroughs, random play's ``warm_start.tries``; with ``env.repeatable`` the same games every iteration, so ``env.pool_size``."""
    if config["warm_start"]["steps"] == 0:
        config["warm_start"] = {"steps": 0}
    elif config["warm_start"].get("source", "walkthrough") == "walkthrough":  # no random play: its tries
        config["warm_start"].pop("tries", None)
    if config["env"]["repeatable"]:
        config["env"].pop("pool_size", None)
    return config


def composed(overrides: list[str]) -> dict:
    cfg = OmegaConf.to_container(OmegaConf.structured(compose_train(overrides)))
    cfg["env"]["decode_groups"] = None  # decided for the machine at start; the file holds the setting
    return without_inert_keys(cfg)


def test_the_default_is_the_measured_warm_start_run_and_rl_alone_recipes_keep_none():
    """The default clones 512 training walkthroughs in two passes, then anchors 12 PPO iterations on those
    games to that policy, on the game as it is: it must be the run whose figures the README gives for
    it, as typed (bench/results/learn_default12p512_default.json, its recorded configs). The RL-alone
    recipes and the blog post's keep neither, as measured."""
    default = composed([])
    for recorded in recorded_configs("learn_default12p512_default.json"):
        assert {k: default[k] for k in recorded} == recorded
    assert (default["warm_start"]["steps"], default["warm_start"]["games"], default["ppo"]["kl_coef"]) == (128, 512, 0.1)
    assert (default["iterations"], default["env"]["pool_size"]) == (12, 512)
    for experiment in ("medium_rl_rule_cpu", "twx_coin_cpu", "twx_simonsays_cpu", "easy_cpu_repeatable", "easy_fresh_gpt2",
                       "easy_repeatable_gpt2", "easy_repeatable_qwen", "medium_fresh_gpt2", "medium_fresh_qwen",
                       "medium_repeatable_gpt2"):
        cfg = compose_train([f"experiment={experiment}"])
        assert (cfg.warm_start.steps, cfg.ppo.kl_coef) == (0, 0.0), experiment
    assert compose_train(["experiment=easy_cpu"]).warm_start.steps == 128  # the default under a name


def test_the_dataclass_defaults_are_the_defaults_of_train_py():
    """One source of truth: TrainConfig() built in code is the config `python train.py` composes."""
    composed = OmegaConf.structured(compose_train())
    built = OmegaConf.structured(resolve(validate(TrainConfig(output_dir="/tmp/unused"))))
    assert OmegaConf.to_container(built) == OmegaConf.to_container(composed)


def test_validate_only_checks_and_resolve_decides_the_auto_values():
    cfg = validate(TrainConfig(output_dir="/tmp/unused"))
    assert (cfg.memory.precision, cfg.env.decode_groups, cfg.ppo.recompute_old) == ("auto", None, None)
    cfg = resolve(cfg)
    assert cfg.env.decode_groups >= 1
    if torch.cuda.is_available():  # on CUDA resolve decides the precision; on a CPU a measurement on the model does
        assert cfg.memory.precision in {"32-true", "bf16-mixed"}
        assert cfg.ppo.recompute_old == (cfg.memory.precision != "32-true")
    else:
        assert (cfg.memory.precision, cfg.ppo.recompute_old) == ("auto", None)


def test_auto_precision_is_measured_on_a_cpu_and_native_bf16_on_a_gpu(monkeypatch):
    """On a CPU resolve leaves ``auto`` (and recompute_old) to the measurement on the built model
    (tests/test_precision_choice.py); an explicit option is resolved; on CUDA bf16 exactly where
    the GPU computes it natively."""
    cpu = ["trainer.accelerator=cpu"]
    auto = compose_train(cpu)
    assert (auto.memory.precision, auto.ppo.recompute_old) == ("auto", None)
    assert compose_train([*cpu, "memory=grad_ckpt", "memory.precision=auto"]).memory.precision == "auto"
    none, bf16 = compose_train([*cpu, "memory=none"]), compose_train([*cpu, "memory=bf16"])
    assert (none.memory.precision, none.ppo.recompute_old) == ("32-true", False)
    assert (bf16.memory.precision, bf16.ppo.recompute_old) == ("bf16-mixed", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for native in (True, False):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None, n=native: (8, 0) if n else (7, 5))
        gpu = compose_train()
        assert (gpu.memory.precision, gpu.ppo.recompute_old) == (("bf16-mixed", True) if native else ("32-true", False))


def test_auto_precision_is_judged_on_the_runs_own_gpus(monkeypatch):
    """A machine whose GPU 0 computes bf16 natively (an A100) and GPU 1 does not (a T4): a run on
    GPU 1 trains in 32-true, one on GPU 0 in bf16, one on both in 32-true (every rank the same)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: {0: (8, 0), 1: (7, 5)}[i])
    for devices, precision in (("[1]", "32-true"), ("[0]", "bf16-mixed"), ("2", "32-true"), ("1", "bf16-mixed"),
                               ("-1", "32-true")):
        assert compose_train([f"trainer.devices={devices}"]).memory.precision == precision, devices


def test_the_rl_alone_medium_recipe_is_its_measured_run():
    """experiment=medium_rl_rule_cpu is the run whose figures its file and the README give for it (the
    recorded configs of its three seeds)."""
    recipe = composed(["experiment=medium_rl_rule_cpu"])
    for recorded in recorded_configs("learn_medium12_fewest_dropcache_epochs1_lr2_block_repeats.json"):
        assert recorded["experiment"] == "medium_rl_cpu"  # its name then (RENAMED_OPTIONS)
        recorded["experiment"] = "medium_rl_rule_cpu"
        assert {k: recipe[k] for k in recorded} == recorded


@pytest.mark.parametrize("experiment, result_file", [
    ("medium_ppo_cpu", "learn_medium68_ws1024_default.json"),
    ("mtt_w2o3q4_cpu", "learn_mtt_w2o3q4_ws1024_default.json"),
    ("mtt_w4o6q8_cpu", "learn_mtt_w4o6q8_default.json"),
    ("hard_ppo_cpu", "learn_hard68_ws1024_default.json"),
])
def test_each_cloning_then_ppo_recipe_is_its_measured_run(experiment, result_file):
    """experiment=<name> is the run whose figures its file and the README give for it: the configs its
    seeds recorded (medium_ppo_cpu's and mtt_w2o3q4_cpu's measured with their cloning as overrides, since
    adopted)."""
    recipe = composed([f"experiment={experiment}"])
    for recorded in recorded_configs(result_file):
        assert recorded["experiment"] == experiment
        assert {k: recipe[k] for k in recorded} == recorded


def test_the_medium_recipe_is_the_measured_warm_start_command():
    """bench/results/learn_medium_bc256_default.json measured medium_cpu's values as command-line
    overrides: a warm start alone on medium games (two passes over 256 training walkthroughs), every
    admissible command offered, cut turns fed again, RL alone's settings for any iterations added
    after it (no anchor, exploration 0.3, two PPO passes at the CPU rates, no replays), 64 held-out
    games at the end. The recipe must be that run, or its documented figures are not its own."""
    recipe = OmegaConf.structured(compose_train(["experiment=medium_cpu"]))
    measured = OmegaConf.structured(compose_train([
        "env=medium", "env.block_repeats=false", "env.drop_turns_from_cache=false", "env.pool_size=256",
        "warm_start.steps=64", "warm_start.games=256", "iterations=0",
        "ppo.kl_coef=0", "ppo.explore=0.3", "ppo.epochs=2", "ppo.lr_lm=1e-4", "ppo.lr_lm_min=1e-5",
        "ppo.lr_value=1e-3", "curriculum.replay=0", "eval.every=6", "eval.games=64", "eval.train_games=0",
        "eval.before_training=false"]))
    assert (recipe.experiment, measured.experiment) == ("medium_cpu", None)
    recipe.experiment = measured.experiment
    assert OmegaConf.to_container(recipe) == OmegaConf.to_container(measured)


def test_the_gpu_preset_sizes_the_rollout_per_gpu_and_scales_with_the_gpus():
    """trainer=gpu: 64 envs decoded on each GPU (the ranks split env.num_envs), games stepped on
    workers (so two decode groups overlap stepping and decoding), 64 evaluation games at once."""
    on_cpu = ["trainer=gpu", "trainer.accelerator=cpu"]  # the sizes, composed where no GPU is
    cfg = compose_train(on_cpu)
    assert (cfg.env.num_envs, cfg.env.step_workers, cfg.eval.batch) == (64, 4, 64)
    assert compose_train([*on_cpu, "trainer.devices=4", "trainer.strategy=ddp"]).env.num_envs == 256
    assert compose_train([*on_cpu, "trainer.devices=[0,2]", "trainer.num_nodes=2"]).env.num_envs == 256
    assert compose_train([*on_cpu, "env.num_envs=32"]).env.num_envs == 32  # a given size wins
    assert compose_train(["trainer.accelerator=cpu"]).env.num_envs == 16  # the CPU default is untouched


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_of_every_group_composes(group):
    found = options(group)
    assert found or group == "experiment"
    for option in found:
        if group == "memory" and option in CUDA_ONLY and not torch.cuda.is_available():
            # On a CPU machine these must refuse at start, pointing at the CPU alternative.
            with pytest.raises(ConfigError, match="needs a CUDA GPU and none is available; on a CPU use memory="):
                compose_train([f"{group}={option}"])
            continue
        if (group, option) in {("sweep", "gpus"), ("trainer", "gpu")} and not torch.cuda.is_available():
            with pytest.raises(ConfigError, match="trainer.accelerator='gpu' is not allowed: needs a CUDA GPU"):
                compose_train([f"{group}={option}"])
            continue
        if group in ("env", "experiment") and option.startswith("twx_") and not java_available():
            with pytest.raises(ConfigError, match="no `java` is on the PATH. Install a Java runtime"):
                compose_train([f"{group}={option}"])  # refused at start, with the command that installs it
            continue
        cfg = compose_train([f"{group}={option}"])
        if group == "env":
            assert cfg.env.name == option
        if group in {"model", "logger", "memory"}:
            assert getattr(cfg, group).name == option


@pytest.mark.parametrize("override, message", [
    ("ppo.lr_lm=-0.001", "ppo.lr_lm=-0.001 is not allowed: a number > 0"),
    ("env.num_envs=0", "env.num_envs=0 is not allowed: an integer >= 1"),
    ("env.game=impossible", "env.game='impossible' is not allowed: one of ['textworld', 'tw-simple'"),
    ("env.rooms=0", "env.rooms=0 is not allowed: an integer >= 1 with env.game=textworld"),
    ("env.max_steps=0", "env.max_steps=0 is not allowed: an integer >= 1"),
    ("ppo.gamma=1.5", "ppo.gamma=1.5 is not allowed: a number in (0, 1]"),
    ("ppo.temperature_min=2.0", "ppo.temperature_min=2.0 is not allowed"),
    ("ppo.target_kl=-0.5", "ppo.target_kl=-0.5 is not allowed: a number > 0, or null"),
    (["trainer.accelerator=gpu", "trainer.strategy=ddp_fork"],
     "trainer.strategy='ddp_fork' is not allowed: not a fork-started DDP on a GPU"),
    (["trainer.accelerator=cuda", "trainer.strategy=ddp_notebook"],
     "trainer.strategy='ddp_notebook' is not allowed: not a fork-started DDP on a GPU"),
    ("env.keep_answers=['read cookbook']", "env.keep_answers=['read cookbook'] is not allowed: a list of single words"),
])
def test_bad_values_fail_naming_key_value_and_rule(override, message):
    with pytest.raises(ConfigError) as err:
        compose_train(override if isinstance(override, list) else [override])
    assert message in str(err.value)


def test_unknown_keys_and_wrong_types_fail_at_composition():
    with pytest.raises((ConfigCompositionException, ConfigKeyError), match="lr_typo"):
        compose_train(["ppo.lr_typo=1"])
    with pytest.raises((ConfigCompositionException, ValidationError), match="num_envs"):
        compose_train(["env.num_envs=many"])
    with pytest.raises(ConfigCompositionException, match="impossible"):
        compose_train(["env=impossible"])


def test_the_cli_prints_one_clear_line_for_a_bad_value(tmp_path):
    out = subprocess.run([sys.executable, "train.py", "ppo.lr_lm=-1", f"hydra.run.dir={tmp_path}"],
                         capture_output=True, text=True, cwd=CONF_DIR.parent, timeout=600)
    assert out.returncode != 0
    assert "error: ppo.lr_lm=-1.0 is not allowed: a number > 0" in out.stderr
    assert "Traceback" not in out.stderr


def test_other_games_are_shown_with_the_prompt_the_policy_was_trained_with():
    """textrl-eval --env, textrl-play, textrl-attention and curriculum stages play their games with
    the policy's prompt settings, the answers it kept in view (env.keep_answers) included."""
    from dataclasses import replace

    from textrl.config import load_env_config

    policy = replace(load_env_config("twx_cookingworld"), keep_answers=["read"], goal_last=False, history_len=3)
    shown = load_env_config("easy").with_prompt_of(policy)
    assert (shown.name, shown.keep_answers, shown.goal_last, shown.history_len) == ("easy", ["read"], False, 3)
