"""What ``torch.compile`` of the transformer blocks buys on this CPU, measured on the blocks alone.

Issue 32 measured it on an AMD EPYC (the whole blocks compiled: 0.81-0.86x on the update's forward
and backward, nothing in a whole medium iteration; the option built on it was reverted, and this
script with it, docs/results.md "torch.compile of the blocks"). Issue 69's profile on an Intel Xeon
with AMX puts a third of the update outside the matrix products and attention (elementwise work,
copies, casts), which a compiler fuses into fewer passes over memory: this script, brought back,
measures it there. It times SmolLM2-135M (its top ``model.trainable_layers`` blocks trainable) under
the precision ``memory=auto`` resolves to here, on the two shapes of a CPU iteration:

* ``update``: the PPO update's forward and backward of one unpadded sequence (``ppo.minibatch_size=1``)
  of ``--tokens`` tokens, the frozen blocks replaying a recorded output as in training
  (``textrl.policy.speed.frozen_prefix``), the weights cast once per step (``weights_cast_once``),
  so only the trainable blocks run;
* ``forward`` (``--phases update forward``): a no-grad forward of every block over one such sequence.

Variants, each on a freshly built model: ``eager``; ``mlp_norms_dynamic`` (each block's MLP and two
RMSNorms compiled with dynamic shapes, attention eager); ``blocks_static`` (each block compiled
whole, specialised to the one length timed: a best case a run, whose lengths change at nearly every
call, cannot have); ``blocks_dynamic`` (whole blocks, dynamic shapes). ``first_s`` is the first call
(compilation included); ``best_s`` the best of ``--repeats`` after it; ``max_abs_diff`` the largest
deviation of the last hidden states from eager's, beside ``eager_max_abs``. The variants run in
``--rounds`` rounds, in alternating order; ``vs_eager`` is a round's ratio to that round's eager,
``summary`` the median over rounds. Inductor needs a C++ compiler (g++ on these machines).

    python bench/compile_blocks.py --tokens 700 1400 --rounds 2 --out bench/results/compile_blocks_amx.json
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
from textrl.policy.model import build_policy
from textrl.policy.speed.frozen_prefix import FrozenPrefix, transformer_blocks
from textrl.policy.speed.precision import AUTOCAST_DTYPES, choose_precision

VARIANTS = ("eager", "mlp_norms_dynamic", "blocks_static", "blocks_dynamic")


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
            with autocast(), policy.weights_cast_once(), prefix.replay(frozen_out):
                hidden = policy.hidden(ids, mask, pos)[0]
                loss = hidden.float().square().mean()
            loss.backward()
            return hidden.detach()
    else:
        compiled(variant, transformer_blocks(policy.lm))

        def run():
            with torch.no_grad(), autocast(), policy.weights_cast_once():
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


def cpu_flags() -> list[str]:
    """The CPU's matrix and bf16 flags (AMX, AVX512-BF16): what decides bf16's speed here."""
    text = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512f")))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[700, 1400])
    parser.add_argument("--phases", nargs="+", default=["update"], choices=["update", "forward"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench/results/compile_blocks.json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    policy, _ = build_policy(load_model_config("smollm2"))
    choice = choose_precision(policy, "cpu")
    del policy
    rows, summary = [], []
    for phase in args.phases:
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
                            "machine": platform.machine(), "cpu_flags": cpu_flags()}, argv, show={"summary": summary})


if __name__ == "__main__":
    main()
