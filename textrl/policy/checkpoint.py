"""Reading textrl training checkpoints: for resuming (train.py ckpt_path=...) and for loading the
trained policy (textrl-eval, textrl-play, textrl-export).

A checkpoint holds what training changes. With LoRA the frozen base weights are left out; with
``model.trainable_layers`` the frozen lower blocks and embeddings are too, and come back from the
model config when the policy is built, checked against the SHA-256 of the frozen weights the run
trained on (``frozen_fingerprint``), so a different base model is refused instead of mixed in."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import torch
from omegaconf import OmegaConf

from textrl.config import TrainConfig, load_env_config
from textrl.policy.model import PolicyValueModel, build_policy


class CheckpointError(ValueError):
    pass


def load(path: str | Path) -> dict:
    """A checkpoint's contents, read with ``weights_only=True``: tensors, containers and numbers
    only, so a checkpoint from someone else cannot run code when it is opened. Lightning's own
    entries need nothing more (pinned by tests/test_training.py)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def read_checkpoint(path: str | Path, option: str = "ckpt_path") -> tuple[Path, dict]:
    """The checkpoint's path and contents; fails before any model is built if it is unusable.

    ``option`` names the setting the path came from, for the error message.
    """
    ckpt = Path(path).expanduser()
    if not ckpt.is_file():
        raise CheckpointError(f"{option}={path} does not exist; pass a file such as <run>/checkpoints/last.ckpt")
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


def checkpoint_config(state: dict) -> TrainConfig:
    saved = OmegaConf.create(state["textrl"]["config"])
    env = saved.get("env", {})
    if "difficulty" in env:
        # written before env options named their games (env.difficulty, max_steps null = the
        # difficulty's): the same games and step limit under today's keys
        preset = load_env_config(env.pop("difficulty"))
        env.max_steps = env.get("max_steps") or preset.max_steps
        for key in ("name", "game", "rooms", "objects", "quest_length", "theme"):
            env[key] = getattr(preset, key)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), saved))


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


def load_checkpoint_policy(path: str | Path, option: str = "checkpoint",
                           cache_dir: str | None = None) -> tuple[PolicyValueModel, object, TrainConfig]:
    """The policy (with any LoRA adapters), tokenizer and training config stored in a checkpoint.
    Models are found or converted under ``cache_dir`` (the user's; None: the default cache), never
    the directory the checkpoint names: nothing read from a checkpoint decides where files go."""
    _, state = read_checkpoint(path, option)
    cfg = checkpoint_config(state)
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty, cache_dir, cfg.memory)
    load_policy_weights(policy, state, cfg.memory.lora, f"{option}={path}")
    return policy, tokenizer, cfg
