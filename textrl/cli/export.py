"""textrl-export: turn a training checkpoint into a plain Hugging Face model directory.

    textrl-export outputs/<date>/<time>/checkpoints/best-12.ckpt exported/

LoRA adapters are merged into the base weights; the value head is saved beside the model as
``value_head.safetensors``. The directory loads with ``AutoModelForCausalLM.from_pretrained`` and
with ``model.path=exported/ model.source=hub`` in textrl.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from safetensors.torch import save_file

from textrl.policy.checkpoint import CheckpointError, load_checkpoint_policy


def export(ckpt: str | Path, out: str | Path, cache_dir: str | None = None, model_path: str | None = None) -> Path:
    policy, tokenizer, cfg = load_checkpoint_policy(ckpt, cache_dir=cache_dir, model_path=model_path)
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
    ap.add_argument("--model-path", help="the model directory a checkpoint was trained from (model.path=DIR); never taken from the checkpoint")
    ap.add_argument("--cache-dir", help="converted models (default: $TEXTRL_CACHE or ~/.cache/textrl; never a checkpoint's)")
    args = ap.parse_args(argv)
    try:
        print(f"exported to {export(args.checkpoint, args.out, args.cache_dir, args.model_path)}")
    except CheckpointError as exc:
        raise SystemExit(f"error: {exc}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
