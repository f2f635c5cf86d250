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

Beside them, each phase's achieved model FLOP/s as a share of the machine's matrix-multiply peak
for the precision the run uses (``bench/peak.py``: fp32, or bf16 under bf16-mixed; the best of its
square and model-shaped products). The peak is measured in this process before the bounds, at the
run's threads (``--peak measure``, the default: one run is self-consistent), or read from a file
(``--peak bench/results/peak.json``); ``peak.source`` says which. Model FLOPs count the real tokens
(padding left out) of what the run computes:

* forward, per token: the sum over the blocks the call runs of 2 x W + 4 x A x c, where W is the
  block's linear weights (every ``nn.Linear`` and GPT-2 ``Conv1D``, in x out; LoRA's adapters
  included), A its attention width (heads x head_dim: SmolLM2's 9 x 64 = 576, its hidden size) and
  c the keys the token attends to (its position in its row + 1: what the row's cache holds before
  it, and itself). So per token 2 x (the block parameters the forward multiplies by) + 4 x layers
  x hidden x c. The embedding lookup multiplies nothing; the head and the value head run only at
  the forks (a fork's few children: ``logits_of``), ~0 per token, and are left out.
* backward, per token, over the blocks at or above the lowest one with a trainable parameter (none
  below it): 2 x W (input gradients) + 2 x W_trainable (weight gradients) + 8 x A x c (attention's
  gradients to Q, K and V: twice its forward, whether or not the block's weights train). A
  trainable block costs 2x its forward; a frozen block above the lowest trainable one 1x on its
  weights (input gradients only) and 2x on its attention; a block below it 0.
* rollout: the forward of every block over every token the decoder's packed calls feed (prompts,
  fork levels, bootstrap values), c from the row's cache; FLOP/s over the model calls' seconds
  (``perf/rollout_prefill_s + perf/rollout_fork_s``) and over the whole rollout.
* update: the forwards of the recompute of the old log-probs and of the KL reference, and the epochs'
  forward + backward, over each training sequence (c = its position in the sequence + 1); a forward
  that replays the frozen blocks' recorded output (``ppo.cache_frozen``) runs -- and counts -- the
  blocks above them only, and the last block's MLP only at the positions a decision reads
  (``PolicyValueModel.last_mlp_at``; older commits everywhere). FLOP/s of the epochs over
  ``perf/update_s``, and of all of it over update + recompute + reference.

The tokens and contexts are counted exactly, in this process: during each training iteration (not the
evaluation) the decoder's packed call (``ConstrainedDecoder._feed``) and the update's forward
(``decision_forward``) are wrapped to add up each call's tokens and keys. A commit without them
gets null FLOP figures (``flops_error`` says why).

Writes ``bench/results/iteration.json``. Measure an older commit with this same script in a work
tree of that commit (``PYTHONPATH=<tree> python bench/iteration.py --out ...``): phases its metrics
do not log are null, the wall times are comparable, and the A/B ratio is what counts.

    python bench/iteration.py                                 # default config, 2 iterations
    python bench/iteration.py --iterations 2 -- env.num_envs=32
    python bench/iteration.py --peak bench/results/peak.json     # the peak from bench/peak.py's file
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import json
import platform
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

import peak  # bench/peak.py
from compose import train_config  # bench/compose.py
from result import cpu_model, write_result  # bench/result.py (the script directory is on sys.path)
from textrl.config import native_bf16
from textrl.policy.decoding import ConstrainedDecoder
from textrl.policy.model import build_policy

from textrl.training.datamodule import RolloutDataModule

try:  # commits before the frozen-block replay have no FrozenPrefix: no replayed bound there
    from textrl.policy.speed.frozen_prefix import FrozenPrefix
except ImportError:
    try:  # commits before textrl/policy/speed/ held it in textrl/policy/
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
    """The model's forward and forward+backward tokens/s under the run's precision, and its FLOPs
    (``ModelFlops``, as a dict)."""
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
    # commits since the update's forwards run the last block's MLP at the read positions only
    skips = hasattr(type(policy), "last_mlp_at") and not getattr(cfg.memory, "grad_ckpt", False)
    out["model_flops"] = asdict(ModelFlops.of(policy.lm, skips))
    del policy
    return out


def blocks_of(lm: nn.Module) -> nn.ModuleList:
    """The model's stack of transformer blocks: its longest ModuleList (any Hugging Face causal LM)."""
    return max((m for m in lm.modules() if isinstance(m, nn.ModuleList)), key=len)


def linear_weights(module: nn.Module) -> int:
    """in x out of a linear layer (``nn.Linear``, 4-bit ones included, or GPT-2's ``Conv1D``), else 0."""
    if isinstance(module, nn.Linear):
        return module.in_features * module.out_features
    weight = getattr(module, "weight", None)
    return weight.numel() if type(module).__name__ == "Conv1D" and weight is not None and weight.dim() == 2 else 0


@dataclass
class ModelFlops:
    """A model's FLOPs per forward and backward (module docstring), from its blocks: per block its
    linear weights, those of them that train, and its attention width (heads x head_dim)."""

    linear: list[int]
    trainable: list[int]
    attention: list[int]
    lowest_trainable: int  # the lowest block a backward reaches (0: the embedding trains; len(linear): none)
    # the last block's MLP, which the update's forwards run at the read positions only (0: they run it everywhere)
    last_mlp: int = 0
    last_mlp_trainable: int = 0

    @classmethod
    def of(cls, lm: nn.Module, skips_last_mlp: bool = False) -> "ModelFlops":
        blocks = blocks_of(lm)
        config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
        heads = config.num_attention_heads
        width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
        linear, trainable = [], []
        for block in blocks:
            layers = [m for m in block.modules() if linear_weights(m)]
            linear.append(sum(linear_weights(m) for m in layers))
            trainable.append(sum(linear_weights(m) for m in layers if m.weight.requires_grad))
        in_block = {id(p): b for b, block in enumerate(blocks) for p in block.parameters()}
        lowest, seen_blocks = len(blocks), False
        for p in lm.parameters():  # registration order is data-flow order (freeze_below_top_layers)
            if p.requires_grad:  # the first trainable parameter: in a block, under them, or above
                lowest = in_block.get(id(p), len(blocks) if seen_blocks else 0)
                break
            seen_blocks = seen_blocks or id(p) in in_block
        mlp = getattr(blocks[-1], "mlp", None) if skips_last_mlp else None
        layers = [m for m in mlp.modules() if linear_weights(m)] if mlp is not None else []
        return cls(linear, trainable, [width] * len(blocks), lowest, sum(linear_weights(m) for m in layers),
                   sum(linear_weights(m) for m in layers if m.weight.requires_grad))

    def forward(self, tokens: float, keys: float, first_block: int = 0) -> float:
        """FLOPs of a forward through the blocks from ``first_block`` up over ``tokens`` tokens that
        attend to ``keys`` keys in all (the sum over the tokens of each one's context)."""
        return sum(2 * w * tokens + 4 * a * keys for w, a in zip(self.linear[first_block:], self.attention[first_block:]))

    def backward(self, tokens: float, keys: float) -> float:
        """FLOPs of the backward of such a forward: the blocks from the lowest trainable one up."""
        start = self.lowest_trainable
        return sum(2 * (w + t) * tokens + 8 * a * keys
                   for w, t, a in zip(self.linear[start:], self.trainable[start:], self.attention[start:]))

    def skipped(self, unread: float, backward: bool) -> float:
        """FLOPs the update's forward (and its backward) leaves out at ``unread`` positions: the last
        block's MLP (``PolicyValueModel.last_mlp_at``)."""
        return 2 * self.last_mlp * unread + (2 * (self.last_mlp + self.last_mlp_trainable) * unread if backward else 0)


class Counts:
    """Per training iteration, the tokens each phase's model calls feed and the keys those tokens
    attend to (module docstring), counted by wrapping, inside ``wrapping()``, the decoder's packed
    call, the update's forward and the module's training step of this process."""

    def __init__(self):
        self.iterations: list[dict] = []  # per training step: phase -> tokens, keys, replayed_tokens, replayed_keys
        self.current: dict | None = None
        self.phase = "update"
        self.error: str | None = None

    def add(self, phase: str, tokens: int, keys: int, replayed: bool = False, read: int | None = None) -> None:
        if self.current is None:  # outside a training step: the evaluation, the warm start
            return
        c = self.current.setdefault(phase, {"tokens": 0, "keys": 0, "replayed_tokens": 0, "replayed_keys": 0,
                                            "read_tokens": 0})
        c["tokens"] += tokens
        c["keys"] += keys
        c["read_tokens"] += tokens if read is None else read  # the positions a decision reads (the update's)
        if replayed:
            c["replayed_tokens"] += tokens
            c["replayed_keys"] += keys

    @contextlib.contextmanager
    def guarded(self):
        """Counting never stops the run: an older commit's call that does not fit is noted instead."""
        try:
            yield
        except Exception as exc:
            self.error = self.error or f"{type(exc).__name__}: {exc}"

    @contextlib.contextmanager
    def wrapping(self):
        counts, patched = self, []

        def feed(original):
            @functools.wraps(original)
            def wrapper(decoder, chunks, *args, **kwargs):
                # before the call, which appends the chunks: row r's new tokens follow the tokens
                # its cache holds (``held``: its stream less cut turns; older commits: ``fed``) and
                # attend to them and to themselves, causally
                with counts.guarded():
                    held = getattr(decoder, "held", decoder.fed)
                    counts.add("rollout", sum(len(c) for c in chunks),
                               sum(len(c) * len(f) + len(c) * (len(c) + 1) // 2 for f, c in zip(held, chunks)))
                return original(decoder, chunks, *args, **kwargs)
            return wrapper

        def forward(original):
            @functools.wraps(original)
            def wrapper(policy, batch, *args, **kwargs):
                with counts.guarded():  # before the call, which may record the frozen output
                    prefix = args[1] if len(args) > 1 else kwargs.get("prefix")
                    replayed = prefix is not None and all(prefix.outputs[s.index] is not None for s in batch)
                    lengths = [len(s.input_ids) for s in batch]
                    counts.add(counts.phase, sum(lengths), sum(attended_keys(s) for s in batch), replayed,
                               read=sum(len(set(s.positions)) for s in batch))
                return original(policy, batch, *args, **kwargs)
            return wrapper

        def in_phase(phase):
            def wrap(original):
                @functools.wraps(original)
                def wrapper(*args, **kwargs):
                    counts.phase = phase
                    try:
                        return original(*args, **kwargs)
                    finally:
                        counts.phase = "update"
                return wrapper
            return wrap

        def step(original):
            @functools.wraps(original)
            def wrapper(*args, **kwargs):
                counts.current = {}
                counts.iterations.append(counts.current)
                try:
                    return original(*args, **kwargs)
                finally:
                    counts.current = None
            return wrapper

        try:
            import textrl.ppo.update as update_module
            from textrl.training.module import PPOModule

            for owner, name, wrap in [(ConstrainedDecoder, "_feed", feed), (update_module, "decision_forward", forward),
                                      (update_module.PPOUpdate, "recompute_old", in_phase("recompute")),
                                      (update_module.PPOUpdate, "reference_logprobs", in_phase("reference")),
                                      (PPOModule, "training_step", step)]:
                original = getattr(owner, name)
                setattr(owner, name, wrap(original))
                patched.append((owner, name, original))
            if not hasattr(ConstrainedDecoder(None), "fed"):  # the wrapper reads each row's cached tokens
                raise AttributeError("ConstrainedDecoder keeps no fed tokens per row")
        except Exception as exc:  # an older commit's names differ: no FLOP figures, the run goes on
            self.error = f"{type(exc).__name__}: {exc}"
            for owner, name, original in reversed(patched):
                setattr(owner, name, original)
            patched = []
        try:
            yield self
        finally:
            for owner, name, original in reversed(patched):
                setattr(owner, name, original)


def attended_keys(sequence) -> int:
    """The keys a training sequence's tokens attend to, summed: n(n+1)/2 causally, fewer where cut
    turns are hidden from the tokens after the cut (``textrl.policy.speed.stream``; older commits have none)."""
    n = len(sequence.input_ids)
    drops = getattr(sequence, "drops", ())
    if not drops:
        return n * (n + 1) // 2
    from textrl.policy.speed.stream import blocks  # this tree's (only sequences with drops reach here)

    total = 0
    for q0, q1, ranges in blocks(n, drops):  # every key before the block is seen by all of it
        m = q1 - q0
        total += m * (sum(b - a for a, b in ranges) - m) + m * (m + 1) // 2
    return total


def achieved(it: dict, counts: dict | None, model: ModelFlops, n_frozen: int, peak_gflops: float | None) -> dict | None:
    """One iteration's model FLOPs per phase (module docstring) and their rate against the peak."""
    if not counts or "rollout" not in counts:
        return None

    def rate(flops: float, seconds: float | None) -> dict | None:
        if not seconds:
            return None
        gflops = flops / seconds / 1e9
        return {"seconds": round(seconds, 3), "gflops_per_s": round(gflops, 2),
                "share_of_peak": round(gflops / peak_gflops, 4) if peak_gflops else None}

    def forward(c: dict) -> float:  # replayed forwards run the blocks above the frozen ones only
        return (model.forward(c["tokens"] - c["replayed_tokens"], c["keys"] - c["replayed_keys"])
                + model.forward(c["replayed_tokens"], c["replayed_keys"], first_block=n_frozen))

    def described(c: dict, flops: float) -> dict:
        return {"tokens": c["tokens"], "mean_context": round(c["keys"] / max(c["tokens"], 1), 1),
                "replayed_tokens": c["replayed_tokens"], "gflop": round(flops / 1e9, 2),
                "gflop_per_token": round(flops / max(c["tokens"], 1) / 1e9, 4)}

    r = counts["rollout"]
    flops = model.forward(r["tokens"], r["keys"])
    model_s = (it.get("rollout_prefill_s") or 0.0) + (it.get("rollout_fork_s") or 0.0)
    out = {"rollout": {**described(r, flops), "tokens_logged": it.get("rollout_tokens"),
                       "model_calls": rate(flops, model_s), "phase": rate(flops, it["rollout_s"])}}
    total, seconds = 0.0, 0.0
    for phase, key in (("recompute", "recompute_s"), ("reference", "reference_s"), ("update", "update_s")):
        c = counts.get(phase)
        if c is None:
            continue
        flops = forward(c) + (model.backward(c["tokens"], c["keys"]) if phase == "update" else 0.0)
        flops -= model.skipped(c["tokens"] - c.get("read_tokens", c["tokens"]), backward=phase == "update")
        out[phase] = {**described(c, flops), "rate": rate(flops, it.get(key))}
        total, seconds = total + flops, seconds + (it.get(key) or 0.0)
    if "update" in out:
        out["update"]["tokens_logged"] = it.get("update_tokens")
        out["update_phase"] = {"gflop": round(total / 1e9, 2), "rate": rate(total, seconds)}
    return out


def share_summary(rows: list[dict], peak_gflops: float | None) -> dict | None:
    """Over all measured iterations, each figure's total FLOPs over its total seconds, as a share of
    the peak: rollout (model calls / whole), update (epochs / with recompute and reference)."""
    flops = [r["flops"] for r in rows if r.get("flops")]
    if not flops or not peak_gflops:
        return None
    where = {"rollout_model_calls": ("rollout", "model_calls"), "rollout": ("rollout", "phase"),
             "update": ("update", "rate"), "update_phase": ("update_phase", "rate")}
    out = {}
    for name, (phase, figure) in where.items():
        items = [(f[phase]["gflop"], f[phase][figure]["seconds"]) for f in flops if (f.get(phase) or {}).get(figure)]
        seconds = sum(s for _, s in items)
        out[name] = round(sum(g for g, _ in items) / seconds / peak_gflops, 4) if seconds else None
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
    ap.add_argument("--peak", default="measure",
                    help="'measure' (bench/peak.py's products, in this process, at the run's threads) or a peak.json")
    ap.add_argument("--peak-repeats", type=int, default=3, help="timed rounds of each peak product (best kept)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the training run")
    args = ap.parse_args(argv)

    run_dir = Path(tempfile.mkdtemp(prefix="textrl_iteration_"))
    # RL alone (no warm start, no KL anchor's reference forward): the iterations every iteration.json
    # measured, from the pretrained model (a warm-started policy plays shorter episodes: another
    # workload); an override after them still wins
    overrides = [f"iterations={args.iterations}", f"eval.every={args.iterations}", "eval.before_training=false",
                 "logger=csv", "warm_start.steps=0", "ppo.kl_coef=0", *args.overrides]
    cfg = train_config(overrides, output_dir=str(run_dir))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    RolloutDataModule(cfg).prepare_data()  # games generated (or found) before any clock starts
    peaks = machine_peak(args.peak, cfg, args.peak_repeats)
    print("peak GFLOP/s", peaks["peak_gflops"], flush=True)

    b = bounds(cfg, args.reps, cfg.env.num_envs, args.length)
    model_flops = ModelFlops(**b.pop("model_flops"))
    print("bounds", b, flush=True)
    precision = peak.precision_of(cfg.memory.precision)  # auto is decided by train_config (bench/compose.py)
    peak_gflops = peaks["peak_gflops"].get(precision) if precision else None
    from textrl.cli.train import train  # after the bounds: the same process, a fresh model

    counts = Counts()
    start = time.perf_counter()
    with counts.wrapping():  # microseconds of counting per model call
        train(cfg)
    total = time.perf_counter() - start
    its, eval_s = iterations(run_dir / "logs" / "metrics.csv")
    rows = [breakdown(it, b, cfg) for it in its]
    if counts.error is None and len(counts.iterations) != len(its):
        counts.error = f"{len(counts.iterations)} training steps counted, {len(its)} iterations logged"
    for r, it, c in zip(rows, its, counts.iterations if counts.error is None else [None] * len(its)):
        r["flops"] = achieved(it, c, model_flops, b.get("frozen_blocks") or 0, peak_gflops)
    shares = share_summary(rows, peak_gflops)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__import__("textrl").__file__).parent).stdout.strip()
    out = {
        "iteration_wall_s_mean": statistics.fmean(r["wall_s"] for r in rows),
        "iterations": rows, "evaluation_s": eval_s, "run_s": total, "bounds": b,
        # achieved model FLOP/s over all iterations as a share of the peak of the precision in use
        # (module docstring); each iteration's figures are under its "flops"
        "peak_share": shares, "peak": {**peaks, "precision_in_use": precision, "gflops_in_use": peak_gflops,
                                       "shape_in_use": peaks["peak_shape"].get(precision) if precision else None},
        "model_flops": {**asdict(model_flops), "gflop_per_token_forward_at_context_1": round(
            model_flops.forward(1, 1) / 1e9, 5)},
        "flops_error": counts.error,
        "config": {"overrides": overrides, "precision": cfg.memory.precision, "num_envs": cfg.env.num_envs,
                   "epochs": cfg.ppo.epochs, "minibatch_size": cfg.ppo.minibatch_size,
                   "recompute_old": cfg.ppo.recompute_old, "cache_frozen": getattr(cfg.ppo, "cache_frozen", None),
                   "trainable_layers": cfg.model.trainable_layers},
        "textrl_commit": commit, "cpu_native_bf16": native_bf16(False), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
    }
    write_result(args.out, out, argv, show={"iteration_wall_s_mean": out["iteration_wall_s_mean"],
                                            "iterations": rows, "bounds": b, "peak_share": shares,
                                            "peak_gflops": peaks["peak_gflops"], "precision": precision})


def machine_peak(source: str, cfg, repeats: int) -> dict:
    """The machine's matmul peaks (``bench/peak.py``): measured now at this process's threads on the
    run model's shapes (``source="measure"``), or read from a peak.json (noting whether it was
    measured on this CPU at these threads)."""
    if source == "measure":
        shapes, where = peak.model_shapes(cfg)
        return {**peak.measure(shapes, repeats=repeats), "shapes_from": where, "source": "measured in this process"}
    data = json.loads(Path(source).read_text())
    same = data.get("cpu") == cpu_model() and data.get("torch_threads") == torch.get_num_threads()
    if not same:
        print(f"warning: {source} was measured on {data.get('cpu')} at {data.get('torch_threads')} threads; this run: "
              f"{cpu_model()} at {torch.get_num_threads()} threads", flush=True)
    keep = ("peak_gflops", "peak_shape", "torch_threads", "torch", "cpu", "command", "shapes_from")
    return {**{k: data.get(k) for k in keep}, "source": source, "same_cpu_and_threads": same}


if __name__ == "__main__":
    main()
