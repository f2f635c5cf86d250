"""The config is resolved once: ``textrl.config.resolve`` returns a new config with every value left
to the machine and the model decided, its input unchanged, and after it nothing in a run writes to a
config (a frozen resolved config trains). Renamed options are refused with their new name."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from textrl.cli.train import train
from textrl.config import (CONF_DIR, COMMAND_ROOM, ConfigError, ModelFacts, TrainConfig, check_renamed_options, resolve,
                           validate)
from textrl.training.curriculum import stage_envs
from tests.conftest import SMALL, config

# ---- a recursive freeze, as dataclass(frozen=True) would make every config of the tree ---------------

_FROZEN: dict[type, type] = {}


def _frozen_class(cls: type) -> type:
    """A subclass of the dataclass ``cls`` whose instances refuse assignment once built, as a frozen
    dataclass's do; ``dataclasses.replace`` on one builds another frozen one. Module-level (and so
    picklable by name) within this test module only."""
    if cls not in _FROZEN:
        def __init__(self, *args, **kwargs):
            cls.__init__(self, *args, **kwargs)
            object.__setattr__(self, "_frozen", True)

        def __setattr__(self, name, value):
            if self.__dict__.get("_frozen"):
                raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r} of a resolved {cls.__name__}")
            object.__setattr__(self, name, value)

        def __getstate__(self):  # a copy (copy.deepcopy, pickle) is another object, which may be written:
            # Lightning deep-copies each batch, and a batch holds the env config its games are played with
            return {k: v for k, v in self.__dict__.items() if k != "_frozen"}

        name = f"Frozen{cls.__name__}"
        frozen = type(name, (cls,), {"__init__": __init__, "__setattr__": __setattr__, "__getstate__": __getstate__,
                                     "__module__": __name__, "__qualname__": name})
        globals()[name] = frozen
        _FROZEN[cls] = frozen
    return _FROZEN[cls]


def freeze(obj):
    """``obj`` with every dataclass in its tree replaced by a frozen copy (``_frozen_class``)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = {f.name: freeze(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return _frozen_class(type(obj))(**values)
    return obj


def test_the_freeze_refuses_writes_at_every_level(tmp_path):
    cfg = freeze(config(tmp_path))
    for node, key in [(cfg, "seed"), (cfg.env, "max_prompt_tokens"), (cfg.memory, "precision"), (cfg.trainer, "devices")]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(node, key, getattr(node, key))
    assert dataclasses.replace(cfg, seed=1).seed == 1  # new configs can still be made from it
    with pytest.raises(dataclasses.FrozenInstanceError):
        dataclasses.replace(cfg, seed=1).seed = 2


def test_a_resolved_frozen_config_trains_an_iteration(tmp_path):
    """Nothing in the run writes to a config after the resolve step: not the model's precision, the
    prompt's budget, the resume's paths, nor anything else."""
    cfg = freeze(resolve(config(tmp_path, "iterations=1", "eval.before_training=false")))
    result = train(cfg)
    assert result["trainer"].current_epoch == 1 and result["last"]
    assert result["module"].cfg.memory.precision == "32-true" and result["module"].cfg.ppo.recompute_old is False


def _unresolved(tmp_path, *overrides) -> TrainConfig:
    """The validated config of ``python train.py`` with SMALL's overrides, not yet resolved."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose("train", overrides=[f"output_dir={tmp_path}", *SMALL, *overrides])
    return validate(OmegaConf.to_object(composed))


def test_resolve_returns_a_new_config_with_the_models_values_and_leaves_its_input_as_it_was(tmp_path):
    cfg = _unresolved(tmp_path, "memory=auto", "env.decode_groups=null", "env=hard", "curriculum=easy_to_hard")
    assert (cfg.memory.precision, cfg.ppo.recompute_old, cfg.env.decode_groups) == ("auto", None, None)
    before = copy.deepcopy(cfg)
    asked = []
    facts = ModelFacts(position_limit=600, cpu_precision=lambda: asked.append(1) or "bf16-mixed")  # a CPU's measurement

    resolved = resolve(cfg, facts)
    assert cfg == before  # every node of the input as it was
    assert resolved is not cfg and resolved.memory is not cfg.memory and resolved.env is not cfg.env
    assert (resolved.memory.precision, resolved.ppo.recompute_old, resolved.env.decode_groups) == ("bf16-mixed", True, 4)
    assert resolved.env.max_prompt_tokens == 600 - COMMAND_ROOM < cfg.env.max_prompt_tokens and asked == [1]
    assert all(e.max_prompt_tokens <= 600 - COMMAND_ROOM for e in stage_envs(resolved, facts.position_limit))
    # resolving a resolved config changes nothing and measures nothing again
    assert resolve(resolved, facts) is resolved and asked == [1]

    machine = resolve(cfg)  # without the model: a CPU's auto is left to the measurement on it
    assert cfg == before and (machine.memory.precision, machine.ppo.recompute_old) == ("auto", None)
    assert machine.env.max_prompt_tokens == cfg.env.max_prompt_tokens and machine.env.decode_groups == 4


# ---- ppo=seed is ppo=blog --------------------------------------------------------------------------

RENAMED = "ppo=seed was renamed ppo=blog (the blog post's hyper-parameters)"


@pytest.mark.parametrize("override", ["ppo=seed", "+ppo=seed", "ppo=cpu,seed"])
def test_the_old_spelling_of_the_blog_posts_option_is_refused_with_its_new_name(override, tmp_path):
    with pytest.raises(ConfigError, match=rf"^{RENAMED}$".replace("(", r"\(").replace(")", r"\)")):
        check_renamed_options([override])
    with pytest.raises(ConfigError, match="was renamed ppo=blog"):
        config(tmp_path, override)  # the tests' compose helper refuses it as the entry does


def test_the_blog_option_and_the_seed_key_compose(tmp_path):
    check_renamed_options(["ppo=blog", "seed=3", "experiment=easy_fresh_gpt2"])  # `seed` the run's seed is no option
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        p = OmegaConf.to_object(compose("train", overrides=[f"output_dir={tmp_path}", "ppo=blog"])).ppo
    assert (p.lr_lm, p.lr_lm_min, p.lr_value, p.epochs, p.minibatch_size, p.grad_accum, p.kl_coef) == (
        1e-5, 1e-7, 1e-4, 4, 2, 32, 0.0)


def test_train_py_refuses_ppo_seed_before_hydra_composes():
    out = subprocess.run([sys.executable, "train.py", "ppo=seed"], cwd=CONF_DIR.parent, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == f"error: {RENAMED}", out.stderr[-2000:]


def test_the_rl_alone_medium_recipe_with_the_rule_says_so_in_its_name(tmp_path):
    with pytest.raises(ConfigError, match=r"^experiment=medium_rl_cpu was renamed experiment=medium_rl_rule_cpu"):
        check_renamed_options(["experiment=medium_rl_cpu"])
    assert config(tmp_path, "experiment=medium_rl_rule_cpu").env.block_repeats
