"""Every CUDA-only path of textrl, run once on a GPU, into one file: bench/results/gpu_check.json.

Whoever first has a GPU runs this one command and reads one file. Its steps, in order (each one's
outcome, figures and error, if any, are recorded; a failing step does not stop the others):

* ``machine``: torch, CUDA and library versions; each GPU's name, compute capability and memory.
* ``cuda_tests``: the tests marked ``cuda`` (tests/test_cuda.py: every memory option's iteration
  at ratio 1, fp16's non-finite guard under the real GradScaler, a job's GPU memory given back,
  bf16 judged on the run's GPU), each one's outcome.
* ``iteration/<precision>`` for 32-true, bf16-mixed, 16-mixed, and ``iteration/memory=<option>`` for
  adam8bit, grad_ckpt, lora, qlora: one PPO iteration of SmolLM2 on the GPU (16 easy games, no
  warm start, one 16-game evaluation), with the first-minibatch ratio (``policy/first_logratio_max``:
  0 up to rounding where the update computes the rollout's function), the rollout's recompute gap,
  the phases' seconds, the job's peak GPU memory, and the host-device synchronisations of the
  training step, counted by CUDA itself (``torch.cuda.set_sync_debug_mode``).
* ``iteration/trainer=gpu``: the same iteration under ``trainer=gpu`` (conf/trainer/gpu.yaml: 64
  environments, games stepped on 4 worker processes, evaluation 64 games at once): what the preset
  buys against the 16-environment iterations above (``rollout/decisions_per_s``, ``perf/rollout_s``).
* ``rollout/<n>`` for 16, 64 and 256 environments: one sampled rollout in bf16 where the GPU has
  it (else fp32), training's decoder and grouping (one group on a GPU): decisions/s, tokens/s, model
  calls and milliseconds per call.
* ``ddp``: one iteration on every visible GPU when there is more than one (``trainer=ddp``).

``--dry-run`` (a CPU is enough, under a minute): every step listed with what it would run; the
ones a CPU can run are run there on the tiny model, so the script itself is tested
(tests/test_bench_figures.py).

Where SmolLM2's converted weights are not on the machine (a bare GPU machine: they are larger
than what can be carried to it), ``--prepare DIR`` writes, here, a textrl cache holding SmolLM2's
config and tokenizer only (a few MB: ``DIR/cache/models/smollm2``). On the GPU, with
``TEXTRL_CACHE=DIR/cache``, the tests' tiny model finds its tokenizer there, and
``--random-weights`` builds a model of SmolLM2's architecture with random weights (saved once as
``models/smollm2-random`` in that cache, so that QLoRA loads it as a pretrained model), which
computes as the real one does: every figure here is a speed, a memory or an exactness figure,
none a learning one. ``DIR/site`` holds the packages textrl needs that the lent H200 machine's image
lacks (``CARRIED``). The games are made on the GPU machine (its cores).

    python bench/gpu_check.py                                  # on a GPU, SmolLM2 from textrl's cache
    python bench/gpu_check.py --dry-run --out /tmp/gpu_check.json
    python bench/gpu_check.py --prepare .gpu                   # here; then on the GPU:
    PYTHONPATH=.gpu/site:. TEXTRL_CACHE=.gpu/cache python bench/gpu_check.py --random-weights
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch

from result import write_result  # bench/result.py (the script directory is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ["32-true", "bf16-mixed", "16-mixed"]
MEMORY_OPTIONS = ["adam8bit", "grad_ckpt", "lora", "qlora"]
ROLLOUT_ENVS = [16, 64, 256]
# one iteration of the default (SmolLM2, easy games) sized to a few seconds on a GPU
ITERATION = ["iterations=1", "warm_start.steps=0", "ppo.kl_coef=0", "eval.every=1", "eval.games=16", "eval.batch=16",
             "eval.before_training=false", "eval.train_games=0", "eval.transcripts=0", "env.num_envs=16", "env.pool_size=64"]
# the dry run's CPU stand-in: the tiny model, four games
DRY = ["model=tiny", "env.num_envs=4", "env.pool_size=8", "eval.games=4", "eval.batch=4", "eval.train_games=0", "ppo.minibatch_size=2",
       "trainer.accelerator=cpu", "memory=none"]


@dataclass
class Context:
    dry: bool
    model: list[str]  # the model's overrides
    work: Path  # run directories
    cuda: bool = field(default_factory=torch.cuda.is_available)


@dataclass
class Step:
    name: str
    what: str  # what it runs, as a reader of the result file needs it
    run: object  # Callable[[Context], dict]
    on_cpu: bool = False  # the dry run runs it (on the tiny model, on the CPU)
    needs: str | None = None  # a condition it is skipped without, checked before running


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir
    from textrl.config import CONF_DIR, register_configs, to_train_config

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_train_config(hydra_compose("train", overrides=overrides))


def machine(ctx: Context) -> dict:
    import transformers
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "lightning": L.__version__, "transformers": transformers.__version__, "gpus": []}
    for name in ("peft", "bitsandbytes", "textworld"):
        try:
            out[name] = __import__(name).__version__
        except Exception as exc:  # recorded, not fatal: the steps that need it say so
            out[name] = f"missing ({type(exc).__name__})"
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out["gpus"].append({"name": p.name, "capability": list(torch.cuda.get_device_capability(i)),
                            "memory_gb": round(p.total_memory / 2**30, 1)})
    return out


def cuda_tests(ctx: Context) -> dict:
    """``pytest -m cuda``: each test's outcome (on a CPU all are collected and skipped)."""
    report = ctx.work / "cuda_tests.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                          f"--junitxml={report}", "tests/test_cuda.py"], cwd=ROOT, capture_output=True, text=True)
    outcomes = {}
    if report.is_file():
        import xml.etree.ElementTree as ET
        for case in ET.parse(report).getroot().iter("testcase"):
            kinds = [c.tag for c in case if c.tag in {"failure", "error", "skipped"}]
            detail = next((c.get("message", "")[:300] for c in case if c.tag in {"failure", "error", "skipped"}), "")
            outcomes[case.get("name")] = {"outcome": kinds[0] if kinds else "passed", "detail": detail}
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    counts = {k: sum(o["outcome"] == k for o in outcomes.values()) for k in ("passed", "failure", "error", "skipped")}
    return {"returncode": run.returncode, "summary": summary, "counts": counts, "tests": outcomes,
            "stderr_tail": run.stderr[-2000:] if run.returncode not in (0, 5) else ""}


class SyncCounter(L.Callback):
    """Host-device synchronisations of each training step, as CUDA reports them
    (``torch.cuda.set_sync_debug_mode("warn")`` warns at every synchronising call)."""

    def __init__(self):
        self.counts: list[int] = []
        self._caught = None
        self.precision = None

    def on_train_start(self, trainer, pl_module):
        self.precision = pl_module.cfg.memory.precision  # as resolved (memory=auto decided)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if torch.cuda.is_available():
            self._caught = warnings.catch_warnings(record=True)
            self._records = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._caught is not None:
            torch.cuda.set_sync_debug_mode("default")
            self.counts.append(sum("synchroniz" in str(w.message) for w in self._records))
            self._caught.__exit__(None, None, None)
            self._caught = None


def iteration(overrides: list[str], sized: bool = True):
    """One iteration; ``sized=False`` leaves the rollout's and evaluation's sizes to ``overrides`` (a preset)."""
    base = ITERATION if sized else [o for o in ITERATION if not o.startswith(("env.num_envs=", "eval.batch="))]

    def run(ctx: Context) -> dict:
        import csv

        from textrl.cli.train import run_job

        out_dir = Path(tempfile.mkdtemp(dir=ctx.work, prefix="iteration-"))
        device = ["trainer.accelerator=gpu", "trainer.devices=1"] if ctx.cuda and not ctx.dry else []
        cfg = compose([f"output_dir={out_dir}", *ctx.model, *base, *(DRY if ctx.dry else []), *device, *overrides])
        syncs = SyncCounter()
        start = time.perf_counter()
        run_job(cfg, [syncs])
        wall = time.perf_counter() - start
        with open(out_dir / "logs" / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        train_row = next(r for r in rows if r.get("rollout/episodes"))
        eval_row = next((r for r in rows if r.get("eval/win_rate")), {})
        keep = ["policy/first_logratio_max", "policy/rollout_logratio_max", "optim/skipped_steps", "loss/total",
                "perf/rollout_s", "perf/update_s", "perf/recompute_s", "perf/reference_s", "perf/update_tokens",
                "perf/tokens_per_s", "perf/rollout_tokens", "perf/rollout_tokens_per_s", "rollout/decisions_per_s",
                "perf/peak_mem_gb"]
        figures = {k: float(train_row[k]) for k in keep if train_row.get(k)}
        return {"overrides": overrides, "wall_s": round(wall, 1), **figures, "precision": syncs.precision,
                "eval_s": float(eval_row["perf/eval_s"]) if eval_row.get("perf/eval_s") else None,
                "syncs_per_training_step": syncs.counts or None}
    return run


def rollout(n: int):
    def run(ctx: Context) -> dict:
        from textrl.config import default_decode_groups, load_env_config, native_bf16
        from textrl.games.pool import GamePool, GameSpec
        from textrl.policy.decoding import ConstrainedDecoder
        from textrl.policy.model import build_policy
        from textrl.policy.speed.precision import autocast_context
        from textrl.rollout import Player, Sampling, episode_seeds, play_games

        cfg = compose([f"output_dir={ctx.work}", *ctx.model, *(DRY if ctx.dry else [])])
        cuda = ctx.cuda and not ctx.dry
        n = 4 if ctx.dry else n  # the dry run: four of the tiny model's rows, once
        device = torch.device("cuda" if cuda else "cpu")
        precision = "bf16-mixed" if cuda and native_bf16(True, [0]) else "32-true"
        env = load_env_config("easy")
        distinct = min(n, 64)  # 64 games, each played n / 64 times (its episodes draw their own seeds)
        games = GamePool(GameSpec.from_env(env), cache_dir=cfg.cache_dir).games("eval", distinct)
        games = [g for g in games for _ in range(-(-n // distinct))][:n]
        policy, tokenizer = build_policy(cfg.model, env.step_penalty, cfg.cache_dir)
        policy.to(device).eval()
        groups = default_decode_groups(n, cuda)
        player = Player(policy, tokenizer, [ConstrainedDecoder(policy, drop_cut_turns=env.drop_turns_from_cache)
                                            for _ in range(groups)],
                        autocast=lambda: autocast_context(precision, device))
        rounds = []
        for k in range(1 if ctx.dry else 2):  # the first round warms the kernels up
            _, stats = play_games(player, games, env, Sampling(1.0, episode_seeds(0, k, games)))
            d = stats.decode
            rounds.append({"rollout_s": round(stats.seconds, 3), "decisions": stats.decisions,
                           "decisions_per_s": round(stats.decisions_per_s, 1), "env_s": round(stats.env_s, 3),
                           "tokens": d.tokens, "model_calls": d.calls,
                           "tokens_per_model_s": round(d.tokens / max(d.prefill_s + d.fork_s, 1e-9), 1),
                           "ms_per_model_call": round(1000 * (d.prefill_s + d.fork_s) / max(d.calls, 1), 3)})
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
        del policy, player
        return {"envs": n, "groups": groups, "precision": precision, "warm_up": rounds[0], **rounds[-1],
                "peak_mem_gb": peak}
    return run


def ddp(ctx: Context) -> dict:
    out_dir = Path(tempfile.mkdtemp(dir=ctx.work, prefix="ddp-"))
    run = subprocess.run([sys.executable, "train.py", *ctx.model, *ITERATION, "trainer=ddp", "trainer.accelerator=gpu",
                          "trainer.devices=-1", f"hydra.run.dir={out_dir}"], cwd=ROOT, capture_output=True, text=True)
    return {"returncode": run.returncode, "gpus": torch.cuda.device_count(), "stderr_tail": run.stderr[-2000:]}


def steps() -> list[Step]:
    out = [Step("machine", "versions; each GPU's name, compute capability and memory", machine, on_cpu=True),
           Step("cuda_tests", "pytest -m cuda tests/test_cuda.py", cuda_tests, on_cpu=True)]
    for p in PRECISIONS:
        out.append(Step(f"iteration/{p}", f"one iteration: {' '.join(ITERATION)} memory.precision={p}",
                        iteration([f"memory.precision={p}"]), on_cpu=p == "32-true",
                        needs="bf16" if p == "bf16-mixed" else None))
    for m in MEMORY_OPTIONS:
        out.append(Step(f"iteration/memory={m}", f"one iteration: {' '.join(ITERATION)} memory={m}",
                        iteration([f"memory={m}"]), needs="bf16" if m == "qlora" else None))
    out.append(Step("iteration/trainer=gpu", "one iteration under the GPU preset (64 envs, 4 step workers, "
                    "eval.batch 64), against iteration/32-true's 16 envs", iteration(["trainer=gpu"], sized=False)))
    for n in ROLLOUT_ENVS:
        out.append(Step(f"rollout/{n}", f"one sampled rollout of {n} easy environments", rollout(n), on_cpu=n == 16))
    out.append(Step("ddp", "one iteration on every visible GPU (trainer=ddp trainer.devices=-1)", ddp, needs="gpus>1"))
    return out


def unmet(need: str | None, ctx: Context) -> str | None:
    from textrl.config import native_bf16

    if need == "bf16" and not native_bf16(True, [0]):
        return "the GPU has no native bf16 (compute capability below 8.0)"
    if need == "gpus>1" and torch.cuda.device_count() < 2:
        return f"{torch.cuda.device_count()} GPU visible"
    return None


def random_weights() -> list[str]:
    """A model of SmolLM2's architecture (the cache's ``models/smollm2/config.json``) with random
    weights and its tokenizer, saved once in the cache (``models/smollm2-random``), as the model
    overrides that load it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from textrl.policy.model import model_cache_dir

    source, target = model_cache_dir(None) / "smollm2", model_cache_dir(None) / "smollm2-random"
    if not (target / "model.safetensors").is_file():
        torch.manual_seed(0)
        lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.float32)
        lm.save_pretrained(target)
        AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return ["model=smollm2", "model.source=hub", f"model.path={target}", "model.gguf_file=null"]


# what textrl imports that the lent H200 machine's image lacks (its image has torch, Lightning,
# transformers, PEFT, accelerate, safetensors, PyYAML, numpy, networkx, pytest)
CARRIED = ["hydra-core", "omegaconf", "antlr4-python3-runtime", "hydra-joblib-launcher", "hydra-submitit-launcher",
           "submitit", "textworld", "textworld-express", "TatSu", "hashids", "jericho", "mementos", "termcolor",
           "prompt_toolkit", "wcwidth", "more-itertools", "bitsandbytes", "gguf"]


def prepare(folder: Path, cuda: str = "cuda13") -> dict:
    """For a bare GPU machine, under ``folder``: ``cache/``, a textrl cache holding SmolLM2's config
    and tokenizer from the converted copy here (no weights), and ``site/``, the packages of
    ``CARRIED`` copied from this environment (pure Python but for jericho's and bitsandbytes'
    ctypes libraries, which need no particular Python; of bitsandbytes' CUDA libraries only
    ``cuda``'s), to put on ``PYTHONPATH`` there."""
    from importlib.metadata import distribution

    from textrl.config import load_model_config
    from textrl.policy.model import _converted_gguf, model_cache_dir

    source = _converted_gguf(load_model_config("smollm2"), None)
    target = model_cache_dir(folder / "cache") / "smollm2"
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for f in sorted(source.iterdir()):
        if f.is_file() and not f.name.endswith((".safetensors", ".bin")):
            shutil.copy2(f, target / f.name)
            copied.append(f.name)
    site, size = folder / "site", 0
    for name in CARRIED:
        dist = distribution(name)
        for rel in dist.files or []:
            src = Path(dist.locate_file(rel))
            if ".." in rel.parts or "__pycache__" in rel.parts or rel.parts[0] == "test" or not src.is_file():
                continue  # scripts outside site-packages, compiled caches, TatSu's own tests
            if rel.name.startswith("libbitsandbytes_") and not rel.name.startswith((f"libbitsandbytes_{cuda}",
                                                                                    "libbitsandbytes_cpu")):
                continue
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, site / rel)
            size += src.stat().st_size
    return {"prepared": str(target), "files": copied, "site": str(site), "site_mb": round(size / 2**20, 1),
            "packages": CARRIED}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="list every step; run the CPU-runnable ones on the tiny model")
    ap.add_argument("--random-weights", action="store_true",
                    help="SmolLM2's architecture with random weights (the cache needs only its config and tokenizer)")
    ap.add_argument("--prepare", metavar="DIR", help="write a cache holding SmolLM2's config and tokenizer into DIR/cache and stop")
    ap.add_argument("--only", nargs="*", help="run only the steps whose names start with one of these")
    ap.add_argument("--out", default="bench/results/gpu_check.json")
    args = ap.parse_args(argv)
    if args.prepare:
        print(json.dumps(prepare(Path(args.prepare)), indent=2))
        return
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("bench/gpu_check.py: no CUDA GPU visible; --dry-run lists the steps and runs the CPU-runnable ones")
    model = random_weights() if args.random_weights and not args.dry_run else ["model=smollm2"]
    result = {"dry_run": args.dry_run, "model": model if not args.dry_run else ["model=tiny"],
              "random_weights": args.random_weights and not args.dry_run, "steps": {}}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work:
        ctx = Context(dry=args.dry_run, model=model if not args.dry_run else [], work=Path(work))
        for step in steps():
            if args.only and not any(step.name.startswith(o) for o in args.only):
                continue
            entry = {"what": step.what}
            reason = None if args.dry_run else unmet(step.needs, ctx)
            if args.dry_run and not step.on_cpu:
                entry["status"] = "listed (runs on a GPU)"
            elif reason:
                entry["status"] = f"skipped: {reason}"
            else:
                t0 = time.perf_counter()
                try:
                    entry.update(step.run(ctx), status="ran" + (" on the CPU (dry run)" if args.dry_run else ""))
                except Exception as exc:  # recorded: the next step still runs
                    entry.update(status="failed", error=f"{type(exc).__name__}: {exc}",
                                 traceback=traceback.format_exc()[-3000:])
                entry["seconds"] = round(time.perf_counter() - t0, 1)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            result["steps"][step.name] = entry
            print(f"{step.name}: {entry['status']}" + (f" ({entry['seconds']} s)" if "seconds" in entry else ""), flush=True)
    result["seconds"] = round(time.perf_counter() - start, 1)
    failed = [n for n, e in result["steps"].items() if e["status"] == "failed"]
    result["failed"] = failed
    write_result(args.out, result, argv, show={"failed": failed, "seconds": result["seconds"]})
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
