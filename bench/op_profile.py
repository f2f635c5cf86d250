"""Where a training iteration's CPU time goes, op by op: one rollout and one update under torch.profiler.

``bench/iteration.py`` says how many model FLOPs a phase achieves against the machine's peak; this
says what the rest of the time is. It runs ``python train.py <overrides> iterations=1`` and
profiles its first training rollout (``textrl.rollout.decode_episodes``) and its first update
(``PPOUpdate.run``: the recompute of the old log-probs when on, the KL reference's pass when on,
the PPO epochs and optimizer steps), then stops the run. Each phase's self CPU time is put in classes:

* ``linear``: the matrix products of the model's linear layers (``mm``/``addmm``/``bmm`` whose
  second operand, or whose output, has the shape of one of the model's linear weights: the forward
  and the input gradient, or the weight gradient), with their GFLOP/s (2 x m x k x n per product,
  from the recorded shapes);
* ``other_matmul``: every other product (attention's scores and weighted values, where attention
  runs as products);
* ``attention``: the fused attention kernels (SDPA's CPU flash attention), forward and backward;
* ``softmax``, ``elementwise`` (multiplies, adds, activations, norms' pow/rsqrt/mean, the
  optimizer's fused step), ``copies`` (copy_, casts, cat, index, gather/scatter), ``fills``
  (fill_, zero_, masked_fill_), and ``other``.

The profiler holds every event in memory until the end: a full medium rollout (16 games x 32 steps)
outgrew 24 GB, so the default profiles a reduced iteration (4 games of at most 16 steps); the shares,
not the seconds, are what compares with ``iteration.json``. The profiler's own overhead inflates
small ops (a few microseconds each), so ``other`` and ``copies`` read high.

    python bench/op_profile.py -- experiment=medium_rl_rule_cpu env.drop_turns_from_cache=true

(Not ``profile.py``: the script directory is on ``sys.path``, and that name would shadow the
standard library's ``profile`` module, which ``cProfile`` and so torch import, for every script here.)
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from torch.profiler import ProfilerActivity, profile

from result import write_result  # bench/result.py (the script directory is on sys.path)

REDUCED = ["env.num_envs=4", "env.max_steps=16"]
CLASSES = {
    "attention": ("scaled_dot_product", "flash_attention"),  # the fused kernels, forward and backward
    "softmax": ("softmax",),
    "fills": ("fill_", "zero_", "masked_fill"),
    "copies": ("copy_", "_to_copy", "cat", "index", "gather", "scatter", "clone", "contiguous", "stack", "narrow_copy"),
    "elementwise": ("mul", "add", "sub", "div", "silu", "gelu", "tanh", "pow", "rsqrt", "sqrt", "mean", "neg", "exp",
                    "sum", "adamw", "where", "threshold", "sigmoid"),
}


class Stop(Exception):
    """Raised once both phases are profiled: the run has nothing more to say."""


def linear_shapes(lm: torch.nn.Module) -> set[tuple[int, int]]:
    """The (in, out) of every linear layer, as the weight-side operand of a product shows it either way round."""
    shapes = set()
    for m in lm.modules():
        if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D":
            k, n = m.weight.shape[1], m.weight.shape[0]
            if type(m).__name__ == "Conv1D":
                k, n = n, k
            shapes |= {(k, n), (n, k)}
    return shapes


def classify(events, weights: set[tuple[int, int]]) -> dict:
    """Self CPU seconds per class (module docstring); the linear products' GFLOP/s."""
    seconds = {c: 0.0 for c in ("linear", "other_matmul", *CLASSES, "other")}
    linear_flops = 0.0
    for e in events:
        name = e.key.removeprefix("aten::")
        s = e.self_cpu_time_total / 1e6
        if name in ("mm", "addmm", "bmm"):  # the kernels; aten::linear and aten::matmul only dispatch to them
            shapes = [tuple(x) for x in e.input_shapes if len(x) >= 2]
            a, b = (shapes[-2], shapes[-1]) if len(shapes) >= 2 else (None, None)
            if a and b and tuple(b[-2:]) in weights:
                seconds["linear"] += s
                m = 1
                for d in a[:-1]:
                    m *= d
                linear_flops += 2 * m * a[-1] * b[-1] * e.count
            elif a and b and (a[-2], b[-1]) in weights:  # a weight gradient: grad^T x input gives the weight's shape
                seconds["linear"] += s
                linear_flops += 2 * a[-2] * a[-1] * b[-1] * e.count
            else:
                seconds["other_matmul"] += s
            continue
        for c, names in CLASSES.items():
            if any(n in name for n in names):
                seconds[c] += s
                break
        else:
            seconds["other"] += s
    total = sum(seconds.values())
    return {"self_cpu_s": round(total, 3),
            "seconds": {c: round(v, 3) for c, v in seconds.items()},
            "share": {c: round(v / total, 4) for c, v in seconds.items()} if total else {},
            "linear_gflop": round(linear_flops / 1e9, 1),
            "linear_gflops_per_s": round(linear_flops / 1e9 / seconds["linear"], 1) if seconds["linear"] else None,
            # each op with its input shapes (events are grouped by them), self seconds and calls
            "top_ops": [(e.key, round(e.self_cpu_time_total / 1e6, 3), e.count, [list(x) for x in e.input_shapes])
                        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:20]]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="profile the overrides' own games and steps, not the reduced iteration")
    ap.add_argument("--out", default="bench/results/op_profile.json")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of train.py")
    args = ap.parse_args(argv)

    import tempfile

    import textrl.rollout as rollout
    from compose import train_config  # bench/compose.py
    from textrl.cli.train import train
    from textrl.ppo import update

    phases: dict[str, dict] = {}
    weights: set[tuple[int, int]] = set()

    def profiled(name, original):
        def wrapper(*a, **k):
            if name in phases:
                return original(*a, **k)
            start = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                out = original(*a, **k)
            wall = time.perf_counter() - start
            phases[name] = {"wall_s_profiled": round(wall, 2),
                            **classify(prof.key_averages(group_by_input_shape=True), weights)}
            del prof
            if name == "update":
                raise Stop
            return out
        return wrapper

    original_run = update.PPOUpdate.run

    def run(self, *a, **k):
        weights.update(linear_shapes(self.policy.lm))
        return profiled("update", original_run)(self, *a, **k)

    update.PPOUpdate.run = run
    original_decode = rollout.decode_episodes

    def decode(envs, decoders, *a, **k):
        weights.update(linear_shapes(decoders[0].policy.lm))
        return profiled("rollout", original_decode)(envs, decoders, *a, **k)

    rollout.decode_episodes = decode
    # nothing plays before the first training rollout (no warm start, whose evaluation would come first)
    overrides = [*args.overrides, *([] if args.full else REDUCED), "iterations=1", "eval.before_training=false",
                 "eval.games=1", "eval.train_games=0", "warm_start.steps=0"]
    with tempfile.TemporaryDirectory(prefix="textrl_profile_") as run_dir:
        cfg = train_config(overrides, output_dir=run_dir)  # memory=auto resolved here, as train resolves it
        try:
            train(cfg)
        except Stop:
            pass
        finally:
            update.PPOUpdate.run, rollout.decode_episodes = original_run, original_decode
    if set(phases) != {"rollout", "update"}:
        raise SystemExit(f"profiled {sorted(phases)}: the run ended before a rollout and an update")
    out = {"phases": phases, "overrides": overrides, "reduced": not args.full, "precision": cfg.memory.precision,
           "torch": torch.__version__,
           "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine()}
    write_result(args.out, out, argv, show={p: {k: v for k, v in d.items() if k != "top_ops"} for p, d in phases.items()})


if __name__ == "__main__":
    main()
