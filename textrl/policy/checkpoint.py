"""Reading textrl training checkpoints: for resuming (train.py ckpt_path=...) and for loading the
trained policy (textrl-eval, textrl-play, textrl-export).

A checkpoint holds what training changes. With LoRA the frozen base weights are left out; with
``model.trainable_layers`` the frozen lower blocks and embeddings are too, and come back from the
model config when the policy is built, checked against the SHA-256 of the frozen weights the run
trained on (``frozen_fingerprint``), so a different base model is refused instead of mixed in.

A checkpoint is data, never instructions: it is read without unpickling code (``load``), and what
is built from it takes no location from it (``checkpoint_config``)."""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

from textrl.config import CONF_DIR, MemoryConfig, ModelConfig, TrainConfig, load_env_config, load_model_config
from textrl.policy.model import PolicyValueModel, build_policy


class CheckpointError(ValueError):
    pass


def load(path: str | Path) -> dict:
    """A checkpoint's contents, read with ``weights_only=True``: tensors, containers and numbers
    only, so a checkpoint from someone else cannot run code when it is opened. Lightning's own
    entries need nothing more (pinned by tests/test_training.py).

    Memory-mapped (copy-on-write: writing to a tensor never changes the file): its pages are read
    as they are copied into the model and the optimizer, and the ranks of a DDP requeue on one node
    share them in the page cache instead of each holding the whole file in its own memory. The
    checkpoint writer (``AtomicCheckpointIO``) renames a new file into place and never rewrites a
    mapped one."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def read_checkpoint(path: str | Path, option: str = "ckpt_path") -> tuple[Path, dict]:
    """The checkpoint's path and contents; fails before any model is built if it is unusable.

    ``option`` names the setting the path came from, for the error message.
    """
    ckpt = Path(path).expanduser()
    if not ckpt.is_file():
        # the checkpoints next to it, if any: a warm-start-only run (iterations=0) writes warm_start.ckpt, no last.ckpt
        there = sorted(p.name for p in ckpt.parent.glob("*.ckpt")) if ckpt.parent.is_dir() else []
        raise CheckpointError(f"{option}={path} does not exist; pass a file such as <run>/checkpoints/last.ckpt"
                              + (f" ({ckpt.parent} holds: {', '.join(there)})" if there else ""))
    try:
        state = load(ckpt)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{option}={path} holds objects other than tensors and plain data, which textrl "
                              f"does not load (it could run code): {str(exc).splitlines()[0]}") from exc
    except Exception as exc:
        raise CheckpointError(f"{option}={path} is not a readable checkpoint ({type(exc).__name__}: {exc}); "
                              f"it may be truncated: use another one, e.g. the run's best-*.ckpt") from exc
    missing = [k for k in ("state_dict", "optimizer_states", "textrl") if k not in state]
    if missing or "config" not in state.get("textrl", {}):
        raise CheckpointError(f"{option}={path} is not a textrl training checkpoint (missing {missing or ['config']})")
    return ckpt, state


# options textrl tried and did not adopt, removed since: each key as older checkpoints store it,
# with the value that leaves it off (a checkpoint written with it off reads as today's)
REMOVED_OPTIONS = {"ppo.value_steps_left": False, "ppo.explore_decay": 1.0, "env.shaping": 0.0,
                   "env.repeat_penalty": 0.0, "self_imitation.episodes": 0, "ppo.value_warmup": 0,
                   "ppo.step_budget": None, "model.detach_value": True}
REMOVED_GROUPS = ("self_imitation",)  # removed with every key in them


def _stored(config: dict, key: str):
    """A removed option's value in a stored config, as written; its off value where the config lacks it."""
    group, name = key.split(".")
    return (config.get(group) or {}).get(name, REMOVED_OPTIONS[key])


def removed_options_on(config: dict) -> list[str]:
    """``key=value`` of each removed option (``REMOVED_OPTIONS``) a stored config switches on."""
    on = []
    for key, off in REMOVED_OPTIONS.items():
        value = _stored(config, key)
        if value != off:
            on.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    return on


def without_removed_options(config: dict) -> dict:
    """A stored config (plain data) without the removed options' keys."""
    kept = {k: v for k, v in config.items() if k not in REMOVED_GROUPS}
    for key in REMOVED_OPTIONS:
        group, name = key.split(".")
        if isinstance(kept.get(group), dict):
            kept[group] = {k: v for k, v in kept[group].items() if k != name}
    return kept


def check_resumable(state: dict, origin: str, advice: str = "") -> None:
    """A run trained with a removed option switched on cannot go on without it: refused, naming it."""
    on = removed_options_on(state["textrl"]["config"])
    if on:
        raise CheckpointError(f"{origin} was trained with {', '.join(on)}, "
                              f"{'an option' if len(on) == 1 else 'options'} removed from textrl (not adopted): "
                              f"this textrl cannot resume it; resume it with the textrl commit it was trained "
                              f"with{advice}")


def stored_config(state: dict) -> TrainConfig:
    """The training config a checkpoint holds, as it was written (older keys read as today's, removed
    options dropped): data to compare and show. What builds a model or games from a checkpoint uses
    ``checkpoint_config``."""
    saved = OmegaConf.create(without_removed_options(state["textrl"]["config"]))
    if "env" not in saved:
        saved.env = {}
    env = saved.env
    if "difficulty" in env:
        # written before env options named their games (env.difficulty, max_steps null = the
        # difficulty's): the same games and step limit under today's keys
        preset = load_env_config(env.pop("difficulty"))
        env.max_steps = env.get("max_steps") or preset.max_steps
        for key in ("name", "game", "rooms", "objects", "quest_length", "theme"):
            env[key] = getattr(preset, key)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), saved))


# what a checkpoint's model settings decide: the shape and initialisation of the weights it holds
WEIGHT_SETTINGS = ("trainable_layers", "value_hidden", "init_seed", "architecture")
# where a model's files come from: the model option's, or a directory the user gives
MODEL_LOCATIONS = ("source", "hub_id", "path", "gguf_package", "gguf_file", "tokenizer_from")


def model_options() -> list[str]:
    """The ``model`` group's options (conf/model/*.yaml)."""
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def checkpoint_config(state: dict, model_path: str | Path | None = None, origin: str = "the checkpoint") -> TrainConfig:
    """The config that a checkpoint's policy and games are built from, in which nothing read from the
    checkpoint decides where files are read, written, deleted or run: the model is the ``model``
    option the checkpoint names (conf/model/<name>.yaml, looked up by name) with the checkpoint's
    weight settings (``WEIGHT_SETTINGS``), or the model directory ``model_path`` that the user gives;
    cache and run locations are cleared (the user's own apply); env names and settings, which name
    cache and output folders, must be plain names. ``origin`` names the checkpoint in errors."""
    stored = stored_config(state)
    cfg = replace(stored, model=_model_of(state["textrl"]["config"].get("model") or {}, stored.model, model_path, origin),
                  cache_dir=None, ckpt_path=None, output_dir="")
    _check_plain_names(cfg, origin)
    return cfg


def _model_of(stored: dict, saved: ModelConfig, model_path: str | Path | None, origin: str) -> ModelConfig:
    weights = {key: getattr(saved, key) for key in WEIGHT_SETTINGS}
    known = saved.name in model_options()
    if model_path is not None:  # the user's directory: a Hugging Face model folder
        base = load_model_config(saved.name) if known else ModelConfig(name="custom")
        return replace(base, **weights, source="hub", path=str(model_path), hub_id=None, gguf_package=None,
                       gguf_file=None)
    if not known:
        raise CheckpointError(f"{origin} names model.name={saved.name!r}, which is not a model option "
                              f"({', '.join(model_options())}): a checkpoint's model is built from its model option, "
                              f"never from a location it names; give the model's directory yourself (model_path)")
    option = load_model_config(saved.name)
    # keys an older checkpoint lacks are not differences; a random init of the option's architecture is its own
    moved = [key for key in MODEL_LOCATIONS if key in stored and stored[key] != getattr(option, key)
             and not (key == "source" and stored[key] == "random")]
    if moved:
        raise CheckpointError(f"{origin} was trained on model={saved.name} with "
                              f"{', '.join(f'model.{k}={stored[k]}' for k in moved)} (the option has "
                              f"{', '.join(f'{k}={getattr(option, k)}' for k in moved)}): textrl takes no model location "
                              f"from a checkpoint; give the model's directory yourself (model_path)")
    return replace(option, **weights, source=stored.get("source", option.source))


def _check_plain_names(cfg: TrainConfig, origin: str) -> None:
    """The game cache folder (``textrl.games.pool.GameSpec.key``) and textrl-eval's output folder
    are named after the env's name, game, theme and settings (eval_settings too): from a checkpoint, no
    path in them."""
    e = cfg.env
    named = [("env.name", e.name), ("env.game", e.game), ("env.theme", e.theme),
             *((f"env.{group}.{k}", text) for group in ("settings", "eval_settings")
               for k, v in getattr(e, group).items() for text in (k, v)),
             *(("curriculum.stages", stage) for stage in cfg.curriculum.stages)]
    for key, value in named:
        text = str(value)
        if any(c in text for c in "/\\\0") or text in {".", ".."}:
            raise CheckpointError(f"{origin} has {key}={text!r}: a name, not a path, was expected there")


def check_same_model(cfg: TrainConfig, state: dict, origin: str, advice: str) -> None:
    """A checkpoint that a run loads weights from (``model.init_from``, ``ckpt_path``) must hold a
    policy of the run's model and LoRA setting: another fails here, before anything is built,
    saying what each one is, then ``advice``."""
    source = stored_config(state)
    mine, theirs = cfg.model, source.model
    if _identity(mine, cfg.memory) != _identity(theirs, source.memory):
        raise CheckpointError(
            f"{origin} holds a policy of model={theirs.name} (source {theirs.source}, LoRA {_lora(source.memory)}); "
            f"this run uses model={mine.name} (source {mine.source}, LoRA {_lora(cfg.memory)}). {advice}")
    _check_value_head(state, origin)


def _check_value_head(state: dict, origin: str) -> None:
    """A value head with a value per step left (the removed ``ppo.value_steps_left``) fits no policy
    textrl builds now."""
    if _stored(state.get("textrl", {}).get("config", {}), "ppo.value_steps_left"):
        raise CheckpointError(f"{origin} holds a value head with a value per step left (ppo.value_steps_left=true, "
                              f"an option removed from textrl, not adopted): this textrl builds no such head; use "
                              f"the commit it was trained at")


def _identity(model: ModelConfig, memory: MemoryConfig) -> tuple:
    lora = (memory.lora_r, memory.lora_alpha, memory.lora_targets) if memory.lora else ()
    return model.name, model.source, model.architecture, memory.lora, *lora


def _lora(memory: MemoryConfig) -> str:
    return f"r={memory.lora_r} alpha={memory.lora_alpha}" if memory.lora else "off"


def leaves_frozen_weights_out(cfg: TrainConfig) -> bool:
    """Whether a run's checkpoints hold only what training changes (the trainable blocks, value head
    and buffers) and take the frozen blocks from the model config: ``model.trainable_layers``
    without LoRA (LoRA's checkpoints hold the adapters only)."""
    return cfg.model.trainable_layers is not None and not cfg.memory.lora


def frozen_names(module: torch.nn.Module) -> set[str]:
    """State-dict names of the frozen parameters (tied aliases such as a tied ``lm_head`` included)."""
    return {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def frozen_fingerprint(module: torch.nn.Module, state: dict | None = None, prefix: str = "") -> str:
    """SHA-256 over the frozen parameters' names, shapes and bytes: the module's own (taken when the
    policy is built, before it moves to a device), or those a full checkpoint ``state`` holds for
    them under ``prefix``."""
    digest = hashlib.sha256()
    for name, p in module.named_parameters():
        if not p.requires_grad:
            t = state[prefix + name] if state is not None else p
            digest.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
            digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_frozen(state: dict, fingerprint: str, origin: str) -> None:
    """A checkpoint that left its frozen weights out must have been trained on these ones."""
    saved = state.get("textrl", {}).get("frozen")
    if saved is not None and saved["fingerprint"] != fingerprint:
        raise CheckpointError(f"{origin} was trained on other frozen weights than the ones this model config "
                              f"gives (SHA-256 {saved['fingerprint'][:12]}... vs {fingerprint[:12]}...): use the "
                              f"same model (model.name/path/init_seed) the run was trained with")


def load_policy_weights(policy: PolicyValueModel, state: dict, lora: bool, origin: str) -> None:
    """Put a checkpoint's policy weights (all of them; with LoRA the adapters + value head; with
    ``model.trainable_layers`` the trainable blocks + value head) into ``policy``, built from the
    same model config; ``origin`` names the checkpoint in errors."""
    _check_value_head(state, origin)
    weights = {k.removeprefix("policy."): v for k, v in state["state_dict"].items() if k.startswith("policy.")}
    slim = "frozen" in state.get("textrl", {})
    try:
        missing, unexpected = policy.load_state_dict(weights, strict=not (lora or slim))
    except RuntimeError as exc:
        raise CheckpointError(f"{origin} does not fit this model: {str(exc).splitlines()[0]}") from exc
    if unexpected or (lora and any("lora_" in k or "value_head" in k for k in missing)) \
            or (slim and not set(missing) <= frozen_names(policy)):
        raise CheckpointError(f"{origin} does not fit this model: unexpected {unexpected[:3]}, missing {missing[:3]}")
    if slim:
        check_frozen(state, frozen_fingerprint(policy), origin)


def load_checkpoint_policy(path: str | Path, option: str = "checkpoint", cache_dir: str | None = None,
                           model_path: str | Path | None = None, device: torch.device | None = None,
                           quantize: bool = True, attn_implementation: str | None = None
                           ) -> tuple[PolicyValueModel, object, TrainConfig]:
    """The policy (with any LoRA adapters), tokenizer and training config stored in a checkpoint.
    Models are found or converted under ``cache_dir`` (the user's; None: the default cache), never
    the directory the checkpoint names: nothing read from a checkpoint decides where files go
    (``checkpoint_config``). ``model_path``: the model's directory, for a checkpoint trained from one.
    ``device``: where a QLoRA policy is loaded (``build_policy``; None: ``process_device()``); any
    other policy is returned on the CPU. ``quantize=False`` builds a QLoRA checkpoint's policy on the
    unquantised (fp32) base model, with its adapters (textrl-export). ``attn_implementation``
    overrides the model's (the returned config keeps the trained one)."""
    _, state = read_checkpoint(path, option)
    cfg = checkpoint_config(state, model_path, f"{option}={path}")
    memory = cfg.memory if quantize else replace(cfg.memory, quantize_4bit=False)
    model = cfg.model if attn_implementation is None else replace(cfg.model, attn_implementation=attn_implementation)
    policy, tokenizer = build_policy(model, cfg.env.step_penalty, cache_dir, memory, device)
    load_policy_weights(policy, state, cfg.memory.lora, f"{option}={path}")
    return policy, tokenizer, cfg
