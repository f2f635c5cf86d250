"""What ``torch.compile`` of the transformer blocks would buy on this CPU: the lever issue 32's
profile (``bench/op_profile.py``) points at, measured before building it into the trainer.

The profile says a third of a medium iteration's model time is matrix products running near the
machine's peak and the rest is non-matmul work (softmax, SiLU and multiplies, norms, rotary
embedding, casts), which a compiler can fuse into fewer passes over memory. This times SmolLM2-135M
(the CPU default model, its top ``model.trainable_layers`` blocks trainable) under the precision
``memory=auto`` resolves to here, on the two shapes that make up a CPU iteration:

* ``update``: the PPO update's forward and backward of one unpadded sequence (``ppo.minibatch_size=1``)
  of ``--tokens`` tokens, the frozen blocks replaying a recorded output as in training
  (``textrl.policy.frozen_prefix``), so only the trainable blocks run;
* ``forward``: a no-grad forward of every block over one such sequence, the frozen linears in the
  autocast dtype as in the rollout (the rollout's own calls go through the ragged KV cache, which
  is not compiled here; this is the same blocks' arithmetic on a prompt-sized block).

Variants, each on a freshly built model: ``eager``; ``mlp_norms`` (each block's MLP and its two
norms compiled: the SwiGLU and RMSNorm elementwise chains fused); ``blocks`` (each block compiled
whole, attention included). ``first_s`` is the first call (compilation included); ``best_s`` the
best of ``--repeats`` after it; ``max_abs_diff`` the largest deviation of the last hidden states
from eager's, beside eager's largest hidden value (``eager_max_abs``). Shapes are fixed here, so no recompilation is counted: a run's sequences vary in
length, which costs recompiles (or dynamic-shape kernels) this does not measure.

    python bench/compile_blocks.py      # writes bench/results/compile_blocks.json
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import time

import torch

from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.config import load_model_config
from textrl.policy.frozen_prefix import FrozenPrefix
from textrl.policy.model import build_policy, transformer_blocks
from textrl.policy.precision import AUTOCAST_DTYPES, choose_precision

VARIANTS = ("eager", "mlp_norms", "blocks")


def compiled(policy, variant: str, blocks) -> None:
    for block in blocks:
        if variant == "blocks":
            block.compile()
        elif variant == "mlp_norms":
            for name in ("mlp", "input_layernorm", "post_attention_layernorm"):
                getattr(block, name).compile()


def measure(variant: str, phase: str, tokens: int, repeats: int, precision: str) -> dict:
    torch._dynamo.reset()
    policy, _ = build_policy(load_model_config("smollm2"))
    prefix = FrozenPrefix.of(policy.lm)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (1, tokens), generator=gen)
    mask, pos = torch.ones_like(ids), torch.arange(tokens)[None]
    dtype = AUTOCAST_DTYPES.get(precision)
    autocast = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype else contextlib.nullcontext
    if phase == "update":
        with torch.no_grad(), autocast(), prefix.record() as recorded:
            policy.hidden(ids, mask, pos)
        frozen_out = prefix.recorded_output(recorded)
        compiled(policy, variant, transformer_blocks(policy.lm)[prefix.n_frozen:])

        def run():
            policy.zero_grad(set_to_none=True)
            with autocast(), prefix.replay(frozen_out):
                hidden = policy.hidden(ids, mask, pos)[0]
                loss = hidden.float().square().mean()
            loss.backward()
            return hidden.detach()
    else:
        compiled(policy, variant, transformer_blocks(policy.lm))

        def run():
            with torch.no_grad(), autocast(), policy.frozen_linears_in_autocast_dtype():
                return policy.hidden(ids, mask, pos)[0]
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        best = min(best, time.perf_counter() - start)
    return {"variant": variant, "phase": phase, "tokens": tokens, "first_s": round(first, 3),
            "best_s": round(best, 4), "hidden": out.float()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/results/compile_blocks.json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    policy, _ = build_policy(load_model_config("smollm2"))
    choice = choose_precision(policy, "cpu")
    del policy
    rows = []
    for phase in ("update", "forward"):
        for tokens in args.tokens:
            eager = None  # the first variant's row and hidden states
            for variant in VARIANTS:
                row = measure(variant, phase, tokens, args.repeats, choice.precision)
                hidden = row.pop("hidden")
                eager = eager or (row, hidden)
                row["max_abs_diff"] = float((hidden - eager[1]).abs().max())
                row["eager_max_abs"] = float(eager[1].abs().max())
                row["vs_eager"] = round(row["best_s"] / eager[0]["best_s"], 3)
                rows.append(row)
                print(row, flush=True)
    write_result(args.out, {"rows": rows, "precision": choice.precision, "precision_how": choice.describe(),
                            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                            "machine": platform.machine()}, argv)


if __name__ == "__main__":
    main()
