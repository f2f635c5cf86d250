"""Precision: what ``memory.precision=auto`` decides, and the autocast of a ``memory.precision`` value.

``auto`` on a CPU is decided by measurement (``choose_precision``): a forward of the model over a
sequence and the backward into its trainable weights -- what a rollout's prompt and an update's
sequence cost -- timed in fp32 and under bf16 autocast (with its weights cast once, as training
casts them), and the faster one chosen, once per machine (CPU model, torch threads, torch version,
the model's shapes and trainable size) and cached under the textrl cache. Neither a flag such as
AVX512-BF16 nor the rate of the linear layers alone says which is faster: on some Xeons that report
the flag, bf16 autocast runs slower than fp32 (issue 32), and where its products are faster the
casts, norms and attention around them can eat the gain (issue 69). On CUDA, ``auto`` is bf16 where
the GPU computes it natively (``textrl.config.resolve``).

``autocast_context`` is the autocast of a precision, for code that runs the policy outside the
Trainer (textrl-eval, textrl-play, textrl-attention): the same computation the policy was trained and
evaluated with, whose greedy choices are the ones its transcripts show."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from textrl.config import default_cache_dir, native_bf16

log = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
PRECISIONS = {"32-true", *AUTOCAST_DTYPES}  # the precisions a decision handed down (resume, DDP) may name
MEASURE_TOKENS = 256  # the timed sequence: a rollout prompt's / an update sequence's order of size
MEASURE_REPEATS = 3  # best of
# part of the cache key: a change to how the measurement is made measures again
MEASURE_METHOD = f"forward-backward-tokens{MEASURE_TOKENS}-best{MEASURE_REPEATS}-v2"


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``auto`` decided, with the figures it decided on (tokens/s of the model's forward and
    backward, ``time_training``; None where nothing was measured) and how."""

    precision: str
    how: str  # measured | cached | why nothing was measured
    fp32_tokens_per_s: float | None = None
    bf16_tokens_per_s: float | None = None

    def describe(self) -> str:
        if self.fp32_tokens_per_s is None or self.bf16_tokens_per_s is None:
            return f"precision {self.precision} ({self.how})"
        return (f"precision {self.precision}: a forward and backward of the model over {MEASURE_TOKENS} tokens runs at "
                f"{self.fp32_tokens_per_s:.1f} tokens/s in fp32, {self.bf16_tokens_per_s:.1f} tokens/s under bf16 "
                f"autocast ({self.how})")


def linear_shapes(model: nn.Module) -> Counter:
    """(in_features, out_features) -> how many of the model's linear layers have that shape: its
    ``nn.Linear`` modules (LoRA's adapters and the value head among them) and GPT-2's ``Conv1D``, the
    output embedding left out (the policy never multiplies it out over a sequence). Part of the
    decision's cache key: another architecture or size measures again."""
    lm = getattr(model, "lm", model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    shapes: Counter = Counter()
    for module in model.modules():
        if module is head:
            continue
        if isinstance(module, nn.Linear):
            shapes[(module.in_features, module.out_features)] += 1
        elif type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None and module.weight.dim() == 2:
            shapes[tuple(module.weight.shape)] += 1
    return shapes


def time_training(model: nn.Module, tokens: int = MEASURE_TOKENS, repeats: int = MEASURE_REPEATS) -> tuple[float, float]:
    """(fp32, bf16-autocast) tokens/s of what training computes per token: ``model.hidden`` (the
    policy's forward, no LM head) over one sequence of ``tokens`` random tokens, and the backward into
    its trainable weights, best of ``repeats`` after a warm-up round. Under bf16 the weights are cast
    once (``model.weights_cast_once``), as the rollout and the update cast them. Leaves nothing
    behind: no ``.grad`` (``torch.autograd.grad``), the model's mode restored, its own generator (the
    run's random state is untouched whether the decision is measured or read from the cache)."""
    lm = getattr(model, "lm", model)
    ids = torch.randint(0, lm.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    inputs = (ids, torch.ones_like(ids), torch.arange(tokens)[None])
    trainable = [p for p in model.parameters() if p.requires_grad]
    best = [float("inf"), float("inf")]
    was_training = model.training
    model.eval()  # the same products; no dropout drawing from the run's random state
    try:
        with torch.enable_grad():
            for repeat in range(repeats + 1):  # the first round warms up (oneDNN primitives, allocations)
                for i, bf16 in enumerate((False, True)):
                    with contextlib.ExitStack() as stack:
                        if bf16:
                            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
                            stack.enter_context(model.weights_cast_once())
                        start = time.perf_counter()
                        hidden = model.hidden(*inputs)[0]
                        if trainable and hidden.requires_grad:
                            torch.autograd.grad(hidden.float().sum(), trainable, allow_unused=True)
                        took = time.perf_counter() - start
                    if repeat:
                        best[i] = min(best[i], took)
    finally:
        model.train(was_training)
    return tokens / best[0], tokens / best[1]


def cpu_bf16_autocast() -> bool:
    """Whether bf16 autocast computes a linear layer in bf16 on this CPU at all."""
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return F.linear(torch.ones(2, 8), torch.ones(4, 8)).dtype == torch.bfloat16
    except (RuntimeError, NotImplementedError):
        return False


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def precision_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """Where the decisions are kept: ``<cache>/precision`` (``cache_dir``, else the textrl cache)."""
    return Path(cache_dir).expanduser() / "precision" if cache_dir else default_cache_dir() / "precision"


def _cache_key(model: nn.Module, shapes: Counter) -> dict:
    return {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "method": MEASURE_METHOD, "shapes": sorted([n_in, n_out, count] for (n_in, n_out), count in shapes.items()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def _read_decision(path: Path, key: dict) -> PrecisionChoice | None:
    """The cached decision at ``path``; None where there is none, or it is unreadable (measured again)."""
    try:
        data = json.loads(path.read_text())
        choice = PrecisionChoice(data["precision"], f"measured before, read from {path}",
                                 float(data["fp32_tokens_per_s"]), float(data["bf16_tokens_per_s"]))
        if data["key"] != key or choice.precision not in {"32-true", "bf16-mixed"}:
            raise ValueError("another key or an unknown precision")
        return choice
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:  # json's errors are ValueErrors
        log.warning("%s: unreadable precision decision (%s): measuring again", path, exc)
        return None


def _write_decision(path: Path, key: dict, choice: PrecisionChoice, seconds: float, corrupt: bool) -> PrecisionChoice:
    """Writes the decision atomically (replacing a ``corrupt`` one); where another process wrote one
    for the same key meanwhile (a sweep's jobs starting together), theirs is kept and returned, so
    that they all agree."""
    data = {"precision": choice.precision, "fp32_tokens_per_s": choice.fp32_tokens_per_s,
            "bf16_tokens_per_s": choice.bf16_tokens_per_s,
            "measure_s": round(seconds, 3), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "key": key}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(data, indent=2) + "\n")
            os.chmod(tmp, 0o644)  # mkstemp's 0600: others sharing the cache read it too
            if corrupt:
                os.replace(tmp, path)
            else:
                try:
                    os.link(tmp, path)  # the first writer wins
                except FileExistsError:
                    theirs = _read_decision(path, key)
                    if theirs is not None:
                        return theirs
                    os.replace(tmp, path)  # theirs is unreadable: replaced
                except OSError:  # no hard links on this file system
                    os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        log.warning("could not cache the precision decision in %s (%s): it is measured again next time", path, exc)
    return choice


def choose_precision(model: nn.Module, device: str | torch.device, cache_dir: str | Path | None = None) -> PrecisionChoice:
    """``memory.precision=auto`` for ``model`` on ``device``. CUDA: bf16-mixed where the GPU computes
    bf16 natively, else 32-true. A CPU: the faster of fp32 and bf16 autocast on a forward and
    backward of the model (``time_training``), measured once per CPU model, torch thread count, torch
    version, shapes and trainable size, and kept in ``<cache>/precision/<key>.json``; a later run
    reads it without measuring.
    Where bf16 autocast does not compute in bf16 at all, 32-true without measuring."""
    device = torch.device(device)
    if device.type == "cuda":
        native = native_bf16(True, [device.index if device.index is not None else torch.cuda.current_device()])
        return PrecisionChoice("bf16-mixed" if native else "32-true",
                               "native bf16 on this GPU" if native else "no native bf16 on this GPU")
    if device.type != "cpu":
        return PrecisionChoice("32-true", f"no bf16 measurement on {device.type}")
    if not cpu_bf16_autocast():
        return PrecisionChoice("32-true", "no bf16 autocast on this CPU")
    shapes = linear_shapes(model)
    if not shapes:
        return PrecisionChoice("32-true", "no linear layers to measure")
    key = _cache_key(model, shapes)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = precision_cache_dir(cache_dir) / f"{digest}.json"
    cached = _read_decision(path, key)
    if cached is not None:
        return cached
    corrupt = path.exists()
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    ticks, own, start = _busy_ticks(cpus), time.process_time(), time.perf_counter()
    fp32, bf16 = time_training(model)
    seconds = time.perf_counter() - start
    others = _others_cpu_seconds(ticks, _busy_ticks(cpus), time.process_time() - own)
    # other processes on the cores this one needs (2 threads on 2 cores while tests run): every
    # parallel region then waits for a time slice (10 ms for a product of 0.1 ms), which says
    # nothing about the machine. Decided on one thread instead (the ratio per core), and not kept
    threads = torch.get_num_threads()
    if others is not None and threads > 1 and others > (len(cpus) - threads + 0.25) * seconds + 0.05:
        torch.set_num_threads(1)
        try:
            fp32, bf16 = time_training(model)
        finally:
            torch.set_num_threads(threads)
        log.warning("other processes kept this process's CPUs busy while the precision was measured (%.1f of %d "
                    "cores): decided on one thread, not cached (measured again next run)", others / seconds, len(cpus))
        return PrecisionChoice("bf16-mixed" if bf16 > fp32 else "32-true",
                               "measured on one thread, the CPU being busy: not cached", fp32, bf16)
    return _write_decision(path, key, PrecisionChoice("bf16-mixed" if bf16 > fp32 else "32-true",
                                                      f"measured in {seconds:.2f} s, cached in {path}", fp32, bf16), seconds,
                           corrupt)


def _busy_ticks(cpus: list[int]) -> int | None:
    """The busy clock ticks of ``cpus`` so far (/proc/stat: user, nice, system, irq, softirq,
    steal), all processes together; None where that cannot be read."""
    if not cpus:
        return None
    try:
        busy = 0
        for line in Path("/proc/stat").read_text().splitlines():
            name, *fields = line.split()
            if name[3:].isdigit() and name.startswith("cpu") and int(name[3:]) in cpus:
                busy += sum(int(f) for f in fields[:3]) + sum(int(f) for f in fields[5:8])
        return busy
    except (OSError, ValueError):
        return None


def _others_cpu_seconds(before: int | None, after: int | None, own: float) -> float | None:
    """CPU seconds that other processes spent on these CPUs between two ``_busy_ticks``."""
    if before is None or after is None:
        return None
    return (after - before) / os.sysconf("SC_CLK_TCK") - own


# the precision ``auto`` became in this run, for the DDP ranks Lightning starts from its environment
AUTO_PRECISION_ENV = "TEXTRL_AUTO_PRECISION"


def resolve_precision(precision: str, model: nn.Module | None, device: str | torch.device,
                      cache_dir: str | Path | None = None) -> str:
    """``precision``, with ``auto`` decided as training decides it (``choose_precision``, logged)."""
    if precision != "auto":
        return precision
    if model is None:
        raise ValueError("precision=auto is decided on the model: pass the model")
    choice = choose_precision(model, device, cache_dir)
    log.info("memory=auto: %s", choice.describe())
    return choice.precision


def autocast_context(precision: str, device: str | torch.device, model: nn.Module | None = None,
                     cache_dir: str | Path | None = None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` on ``device`` for ``bf16-mixed`` / ``16-mixed`` (what Lightning's mixed
    precision wraps every forward in), no autocast for ``32-true``; ``auto`` is decided as training
    decides it, for ``model`` (``choose_precision``: measured on a CPU, cached under ``cache_dir``)."""
    device_type = torch.device(device).type
    precision = resolve_precision(precision, model, device, cache_dir)
    if precision == "32-true":
        return contextlib.nullcontext()
    if precision not in AUTOCAST_DTYPES:
        raise ValueError(f"precision={precision!r}: expected one of ['32-true', 'bf16-mixed', '16-mixed', 'auto']")
    return torch.autocast(device_type, dtype=AUTOCAST_DTYPES[precision])
