"""One default training iteration against the hardware bound, phase by phase.

In one process on one machine: first the model's bounds -- pure forward tokens/s (no grad, eval
mode, a batch of rollout width) and forward+backward tokens/s of a PPO minibatch, in full and with
the frozen blocks replayed (what later passes over a sequence cost when only the top blocks train)
-- then ``--iterations`` real iterations of ``python train.py`` (its default configuration plus the
overrides given), each broken down from its own ``perf/*`` metrics:

* rollout: games (reset + step), model calls feeding prompts, model calls at fork levels, reading
  logits and drawing, and the rest (Python: prompts, tries); tokens fed, and their rate against the
  forward bound;
* update (with the recompute of the old log-probs and the KL reference's pass, when on): tokens,
  and the seconds the bounds allow for them against the seconds taken;
* evaluation (once, after the last iteration).

Writes ``bench/results/iteration.json``. Measure an older commit with this same script in a work
tree of that commit (``PYTHONPATH=<tree> python bench/iteration.py --out ...``): phases its metrics
do not log are null, the wall times are comparable, and the A/B ratio is what counts.

    python bench/iteration.py                                 # default config, 2 iterations
    python bench/iteration.py --iterations 2 -- env.num_envs=32
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from compose import train_config  # bench/compose.py
from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.config import native_bf16
from textrl.policy.decoding import ConstrainedDecoder
from textrl.policy.model import build_policy
from textrl.training.datamodule import RolloutDataModule

try:  # commits before the frozen-block replay have no FrozenPrefix: no replayed bound there
    from textrl.policy.frozen_prefix import FrozenPrefix
except ImportError:
    FrozenPrefix = None

ROOT = Path(__file__).resolve().parent.parent


def rate(fn, tokens: int, reps: int) -> float:
    """Median tokens/s of ``fn`` over ``reps`` timed calls, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return tokens / statistics.median(times)


def bounds(cfg, reps: int, rollout_rows: int, length: int) -> dict:
    """The model's forward and forward+backward tokens/s under the run's precision."""
    policy, _ = build_policy(cfg.model, cfg.env.step_penalty, cfg.cache_dir, cfg.memory)
    autocast = torch.autocast("cpu", torch.bfloat16) if cfg.memory.precision == "bf16-mixed" else contextlib.nullcontext()
    vocab = policy.lm.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def batch(rows: int):
        ids = torch.randint(0, vocab, (rows, length), generator=gen)
        return ids, torch.ones_like(ids), torch.arange(length)[None].expand(rows, -1)

    policy.eval()
    ids, mask, pos = batch(rollout_rows)

    def forward():
        with torch.no_grad(), autocast:
            policy.hidden(ids, mask, pos)

    out = {"length": length, "forward_rows": rollout_rows,
           "forward_tokens_per_s": rate(forward, ids.numel(), reps)}
    policy.train()
    rows = cfg.ppo.minibatch_size
    t_ids, t_mask, t_pos = batch(rows)

    def train_pass():
        with autocast:
            hidden, _ = policy.hidden(t_ids, t_mask, t_pos)
        hidden.float().square().mean().backward()
        policy.zero_grad(set_to_none=True)

    out["train_rows"] = rows
    out["train_pass_tokens_per_s"] = rate(train_pass, t_ids.numel(), reps)
    frozen = FrozenPrefix.of(policy.lm) if FrozenPrefix is not None else None
    if frozen is not None:
        with torch.no_grad(), autocast, frozen.record() as recorded:
            policy.hidden(t_ids, t_mask, t_pos)

        def replayed_pass():
            with frozen.replay(recorded[0]), autocast:
                hidden, _ = policy.hidden(t_ids, t_mask, t_pos)
            hidden.float().square().mean().backward()
            policy.zero_grad(set_to_none=True)

        def replayed_forward():  # the recompute of the old log-probs once the rollout recorded the frozen output
            with torch.no_grad(), frozen.replay(recorded[0]), autocast:
                policy.hidden(t_ids, t_mask, t_pos)

        out["replayed_pass_tokens_per_s"] = rate(replayed_pass, t_ids.numel(), reps)
        out["replayed_forward_tokens_per_s"] = rate(replayed_forward, t_ids.numel(), reps)
        out["frozen_blocks"] = frozen.n_frozen
        # commits since the rollout records the frozen output (ConstrainedDecoder.capture): no pass
        # of the update runs the frozen blocks
        out["rollout_records_frozen"] = hasattr(ConstrainedDecoder(policy), "capture") and cfg.ppo.cache_frozen
    del policy
    return out


def iterations(metrics_csv: Path) -> tuple[list[dict], float | None]:
    with open(metrics_csv) as f:
        rows = list(csv.DictReader(f))

    def num(row, key):
        return float(row[key]) if row.get(key) not in (None, "") else None

    its = [{k.removeprefix("perf/"): num(r, k) for k in r if k.startswith("perf/")} | {"iteration": int(float(r["iteration"]))}
           for r in rows if r.get("perf/rollout_s")]
    evals = [num(r, "perf/eval_s") for r in rows if r.get("perf/eval_s")]
    return its, evals[-1] if evals else None


def breakdown(it: dict, b: dict, cfg) -> dict:
    """One iteration's phases, tokens and the seconds the bounds allow for them."""
    r = {"iteration": it["iteration"], "rollout_s": it["rollout_s"], "recompute_s": it.get("recompute_s") or 0.0,
         "reference_s": it.get("reference_s") or 0.0, "update_s": it["update_s"]}
    r["wall_s"] = r["rollout_s"] + r["recompute_s"] + r["reference_s"] + r["update_s"]
    if it.get("rollout_prefill_s") is not None:
        parts = {k: it[f"rollout_{k}_s"] for k in ("env", "prefill", "fork", "choose")}
        parts["python"] = it["rollout_s"] - sum(parts.values())
        tokens = it["rollout_tokens"]
        model_s = parts["prefill"] + parts["fork"]
        r["rollout"] = {"seconds": parts, "share": {k: v / it["rollout_s"] for k, v in parts.items()},
                        "tokens": tokens, "model_tokens_per_s": tokens / model_s,
                        # the bound: the same tokens at the batched forward's rate
                        "bound_s": tokens / b["forward_tokens_per_s"],
                        "model_calls_vs_bound": tokens / model_s / b["forward_tokens_per_s"],
                        "rollout_vs_bound": tokens / b["forward_tokens_per_s"] / it["rollout_s"]}
    tokens = it.get("update_tokens") or it["tokens_per_s"] * it["update_s"]  # older commits: no count
    per_pass = tokens / cfg.ppo.epochs
    replayed = b.get("replayed_pass_tokens_per_s")
    cache = replayed is not None and getattr(cfg.ppo, "cache_frozen", False)
    # the passes over each sequence an iteration needs: the recompute (a forward) when on, then the
    # epochs; with the frozen blocks cached, only the first pass over a sequence runs them, and none
    # does once the rollout records them
    recorded = cache and b.get("rollout_records_frozen", False)
    passes = []
    if cfg.ppo.recompute_old:
        passes.append(per_pass / (b["replayed_forward_tokens_per_s"] if recorded else b["forward_tokens_per_s"]))
    for e in range(cfg.ppo.epochs):
        first = e == 0 and not cfg.ppo.recompute_old and not recorded
        passes.append(per_pass / (b["train_pass_tokens_per_s"] if first or not cache else replayed))
    bound_s = sum(passes)
    taken = r["update_s"] + r["recompute_s"]
    r["update"] = {"tokens": tokens, "tokens_per_pass": per_pass, "bound_s": bound_s, "seconds": taken,
                   "update_vs_bound": bound_s / taken}
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions of each bound (median)")
    # a rollout's tokens attend to contexts of up to a full prompt (~1,000 tokens after 8 easy turns):
    # 1,024-token sequences put the bound's average context (512) within that range
    ap.add_argument("--length", type=int, default=1024, help="tokens per sequence in the bound batches")
    ap.add_argument("--out", default="bench/results/iteration.json")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the training run")
    args = ap.parse_args(argv)

    run_dir = Path(tempfile.mkdtemp(prefix="textrl_iteration_"))
    overrides = [f"iterations={args.iterations}", f"eval.every={args.iterations}", "eval.before_training=false",
                 "logger=csv", *args.overrides]
    cfg = train_config(overrides, output_dir=str(run_dir))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    RolloutDataModule(cfg).prepare_data()  # games generated (or found) before any clock starts

    b = bounds(cfg, args.reps, cfg.env.num_envs, args.length)
    print("bounds", b, flush=True)
    from textrl.cli.train import train  # after the bounds: the same process, a fresh model

    start = time.perf_counter()
    train(cfg)
    total = time.perf_counter() - start
    its, eval_s = iterations(run_dir / "logs" / "metrics.csv")
    rows = [breakdown(it, b, cfg) for it in its]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__import__("textrl").__file__).parent).stdout.strip()
    out = {
        "iteration_wall_s_mean": statistics.fmean(r["wall_s"] for r in rows),
        "iterations": rows, "evaluation_s": eval_s, "run_s": total, "bounds": b,
        "config": {"overrides": overrides, "precision": cfg.memory.precision, "num_envs": cfg.env.num_envs,
                   "epochs": cfg.ppo.epochs, "minibatch_size": cfg.ppo.minibatch_size,
                   "recompute_old": cfg.ppo.recompute_old, "cache_frozen": getattr(cfg.ppo, "cache_frozen", None),
                   "trainable_layers": cfg.model.trainable_layers},
        "textrl_commit": commit, "cpu_native_bf16": native_bf16(False), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
    }
    write_result(args.out, out, argv, show={"iteration_wall_s_mean": out["iteration_wall_s_mean"],
                                            "iterations": rows, "bounds": b})


if __name__ == "__main__":
    main()
