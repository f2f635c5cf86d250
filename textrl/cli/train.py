"""``python train.py [overrides]``: the Hydra entry point, and one clear line for a user's error.

The run itself (resume, build, resolve, fit) is ``textrl.training.run.train``, which tests and
benchmarks call directly; it is importable from here too, as ``textrl.cli.train.train``.
"""

from __future__ import annotations

import gc
import logging
import sys

import hydra
import torch
from omegaconf import DictConfig

from textrl.config import CONF_DIR, check_renamed_options, register_configs
from textrl.errors import ConfigError, GameFaultError, GameFileError, NonFiniteError
from textrl.games.env import release_engine_state
from textrl.games.prompt import PromptTooLongError
from textrl.policy.checkpoint import CheckpointError
from textrl.policy.model import ModelNotFoundError
from textrl.training.callbacks import Interrupted
from textrl.training.run import train

__all__ = ["USER_ERRORS", "main", "run_job", "train"]

log = logging.getLogger(__name__)
register_configs()

# bad input, and a run that cannot go on (its last.ckpt stays the last good one)
USER_ERRORS = (ConfigError, ModelNotFoundError, CheckpointError, GameFileError, PromptTooLongError, NonFiniteError,
               GameFaultError)


def run_job(cfg: DictConfig, callbacks: list = ()) -> dict:
    """One ``python train.py`` job: ``train``, then everything it built freed before the job ends
    (the module and the Trainer hold each other, so only the cycle collector frees them) and, on
    CUDA, the caching allocator's free blocks given back. Hydra's joblib launcher (``sweep=gpus``)
    runs the next job in the same worker process, on another GPU: nothing of this job may stay
    reserved on this one. ``callbacks`` are added to the Trainer's (bench/gpu_check.py counts syncs with one).
    Returns the metrics and the run's paths."""
    result = train(cfg, callbacks)
    result = {k: v for k, v in result.items() if k not in ("module", "trainer")}
    release_engine_state()  # the game engine's last parse holds the frames of the run that opened a game
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return result


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def _main(cfg: DictConfig) -> None:
    try:
        result = run_job(cfg)
    except USER_ERRORS as exc:  # one clear line, not a traceback
        raise SystemExit(f"error: {exc}") from None
    except Interrupted as exc:  # a signal: started again, the run resumes from its last.ckpt
        log.warning("%s", exc)
        raise SystemExit(128 + exc.signum) from None
    log.info("done: %s", {k: round(v, 4) for k, v in result["metrics"].items() if k.startswith("eval/")})


def main() -> None:
    """``python train.py``: a renamed option is refused with its new name before Hydra composes
    (which would only say that it is not found), then Hydra's entry."""
    try:
        check_renamed_options([arg for arg in sys.argv[1:] if not arg.startswith("-")])
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    _main()
