"""textrl-export: turn a training checkpoint into a plain Hugging Face model directory.

    textrl-export outputs/<run>/checkpoints/best-12.ckpt exported/

LoRA adapters are merged into the base weights; the value head is saved beside the model as
``value_head.safetensors``. The directory loads with ``AutoModelForCausalLM.from_pretrained`` and
with ``model.path=exported/ model.source=hub`` in textrl.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from textrl.config import TrainConfig
from textrl.policy.model import PolicyValueModel, build_policy


def load_checkpoint_policy(path: str | Path) -> tuple[PolicyValueModel, object, TrainConfig]:
    """The policy (with any LoRA adapters), tokenizer and training config stored in a checkpoint."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    if "textrl" not in state or "config" not in state["textrl"]:
        raise ValueError(f"{path} is not a textrl training checkpoint (no textrl config inside)")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), state["textrl"]["config"]))
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty, cfg.cache_dir, cfg.memory)
    weights = {k.removeprefix("policy."): v for k, v in state["state_dict"].items() if k.startswith("policy.")}
    missing, unexpected = policy.load_state_dict(weights, strict=not cfg.memory.lora)
    if unexpected or (cfg.memory.lora and any("lora_" in k or "value_head" in k for k in missing)):
        raise ValueError(f"{path} does not match its own config: unexpected {unexpected[:3]}, missing {missing[:3]}")
    return policy, tokenizer, cfg


def export(ckpt: str | Path, out: str | Path) -> Path:
    policy, tokenizer, cfg = load_checkpoint_policy(ckpt)
    lm = policy.lm.merge_and_unload() if cfg.memory.lora else policy.lm
    out = Path(out)
    lm.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in policy.value_head.state_dict().items()}, out / "value_head.safetensors")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="textrl-export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    args = ap.parse_args(argv)
    print(f"exported to {export(args.checkpoint, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
