"""textrl-export: turn a training checkpoint into a plain Hugging Face model directory.

    textrl-export outputs/<date>/<time>/checkpoints/best-12.ckpt exported/

LoRA adapters are merged into the base weights; the value head is saved beside the model as
``value_head.safetensors``. The directory loads with ``AutoModelForCausalLM.from_pretrained`` and
with ``model.path=exported/ model.source=hub`` in textrl.

A QLoRA checkpoint (``memory=qlora``) is exported as a plain fp32 model too, never 4-bit weights:
its adapters are put on the unquantised base model (the same model config, loaded without 4-bit
quantisation) and merged there by PEFT's ``merge_and_unload``: the usual way to merge QLoRA
adapters (merging into the 4-bit layers would re-quantise the sums to NF4). The merged model
therefore adds the adapters to the full-precision base, not to the NF4-rounded base weights the
policy trained with: its outputs differ slightly from those of the 4-bit policy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from safetensors.torch import save_file

from textrl.policy.checkpoint import CheckpointError, load_checkpoint_policy


def export(ckpt: str | Path, out: str | Path, cache_dir: str | None = None, model_path: str | None = None) -> Path:
    """Write the checkpoint's policy to ``out`` as a plain fp32 Hugging Face model (module docstring).
    Built on the CPU, where nothing is computed: unquantised, ``build_policy`` places nothing on a GPU."""
    # quantize=False: a QLoRA checkpoint's adapters on the unquantised base (4-bit weights would be
    # saved as bitsandbytes' packed uint8 tensors, which only a quantization_config loads)
    policy, tokenizer, cfg = load_checkpoint_policy(ckpt, cache_dir=cache_dir, model_path=model_path, quantize=False)
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
