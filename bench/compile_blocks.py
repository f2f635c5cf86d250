"""What ``torch.compile`` of the transformer blocks would buy on this CPU: the lever issue 32's
profile (``bench/op_profile.py``) points at, measured before building it into the trainer. (A
trainer option built on the best variant here -- the trainable blocks compiled whole for the
update -- gained nothing measurable in a whole medium iteration and was reverted: docs/results.md,
"torch.compile of the blocks".)

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

Variants, each on a freshly built model: ``eager``; ``mlp_norms_dynamic`` (each block's children
but its attention -- Llama's MLP and two RMSNorms -- compiled with dynamic shapes, as a trainer
option would have to: the rollout's packed calls and the update's sequences have a new length at
nearly every call; the SwiGLU and RMSNorm elementwise chains fused); ``mlp_norms_static`` (the same
parts, kernels specialised to the one length timed here: a best case a run cannot have);
``blocks_static`` (each block compiled whole, attention included, specialised too);
``blocks_dynamic`` (whole blocks, dynamic shapes). ``first_s`` is the first call (compilation
included; inductor's on-disk cache makes a repeated run's first calls shorter); ``best_s`` the best
of ``--repeats`` after it; ``max_abs_diff`` the largest deviation of the last hidden states from
eager's, beside eager's largest hidden value (``eager_max_abs``). The variants run in ``--rounds``
rounds, in alternating order; ``vs_eager`` is a round's ratio to that round's eager, and
``summary`` the median over rounds. Inductor needs a C++ compiler here (g++ on these machines).

    python bench/compile_blocks.py      # writes bench/results/compile_blocks.json
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time

import torch

from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.config import load_model_config
from textrl.policy.frozen_prefix import FrozenPrefix
from textrl.policy.model import build_policy, transformer_blocks
from textrl.policy.precision import AUTOCAST_DTYPES, choose_precision

VARIANTS = ("eager", "mlp_norms_dynamic", "mlp_norms_static", "blocks_static", "blocks_dynamic")


def compiled(variant: str, blocks) -> None:
    dynamic = True if variant.endswith("_dynamic") else None  # None: specialised to the first shapes
    for block in blocks:
        if variant.startswith("blocks"):
            block.compile(dynamic=dynamic)
        elif variant.startswith("mlp_norms"):
            for child in block.children():
                if "attention" not in type(child).__name__.lower():  # LlamaAttention stays eager
                    # an instance attribute: the module's hooks stay outside the compiled code
                    child.forward = torch.compile(child.forward, dynamic=dynamic)


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
        compiled(variant, transformer_blocks(policy.lm)[prefix.n_frozen:])

        def run():
            policy.zero_grad(set_to_none=True)
            with autocast(), prefix.replay(frozen_out):
                hidden = policy.hidden(ids, mask, pos)[0]
                loss = hidden.float().square().mean()
            loss.backward()
            return hidden.detach()
    else:
        compiled(variant, transformer_blocks(policy.lm))

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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench/results/compile_blocks.json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    policy, _ = build_policy(load_model_config("smollm2"))
    choice = choose_precision(policy, "cpu")
    del policy
    rows, summary = [], []
    for phase in ("update", "forward"):
        for tokens in args.tokens:
            ratios = {variant: [] for variant in VARIANTS}
            for round_ in range(args.rounds):
                done = {}  # variant -> (row, hidden states)
                for variant in VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]:
                    row = measure(variant, phase, tokens, args.repeats, choice.precision)
                    done[variant] = (row, row.pop("hidden"))
                    row["round"] = round_ + 1
                eager_row, eager_hidden = done["eager"]
                for variant in VARIANTS:
                    row, hidden = done[variant]
                    row["max_abs_diff"] = float((hidden - eager_hidden).abs().max())
                    row["eager_max_abs"] = float(eager_hidden.abs().max())
                    row["vs_eager"] = round(row["best_s"] / eager_row["best_s"], 3)
                    ratios[variant].append(row["vs_eager"])
                    rows.append(row)
                    print(row, flush=True)
            summary += [{"phase": phase, "tokens": tokens, "variant": variant,
                         "vs_eager_median": statistics.median(ratios[variant]), "vs_eager": ratios[variant]}
                        for variant in VARIANTS[1:]]
    write_result(args.out, {"summary": summary, "rows": rows, "precision": choice.precision,
                            "precision_how": choice.describe(),
                            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                            "machine": platform.machine()}, argv, show={"summary": summary})


if __name__ == "__main__":
    main()
