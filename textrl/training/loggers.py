"""The ``logger`` config group: csv, tensorboard or wandb, each continuing its run on resume."""

from __future__ import annotations

import csv
import logging
import os
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf

from textrl.config import TrainConfig

log = logging.getLogger(__name__)


class ResumableCSVLogger(CSVLogger):
    """CSVLogger that keeps an existing ``metrics.csv`` (Lightning's deletes it), so a resumed run
    appends to its own history instead of starting a new one."""

    @property
    def experiment(self):
        if self._experiment is not None:
            return self._experiment
        path = Path(self.log_dir) / "metrics.csv"
        previous = path.read_text() if path.is_file() else None
        writer = super().experiment
        if previous:
            path.write_text(previous)
            with open(path, newline="") as f:
                writer.metrics_keys = list(csv.DictReader(f).fieldnames or [])
        return writer


class WandbIdCallback(L.Callback):
    """Keeps the W&B run id in checkpoints so a resumed run continues the same W&B run."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if type(trainer.logger).__name__ == "WandbLogger":
            checkpoint.setdefault("textrl", {})["wandb_id"] = trainer.logger.experiment.id


def make_logger(cfg: TrainConfig, run_dir: Path, resume_state: dict | None):
    name = cfg.logger.name
    if name == "csv":
        return ResumableCSVLogger(save_dir=run_dir, name="", version="logs")
    if name == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        return TensorBoardLogger(save_dir=run_dir, name="", version="logs")  # event files append
    from lightning.pytorch.loggers import WandbLogger

    if not os.environ.get("WANDB_API_KEY") and os.environ.get("WANDB_MODE") is None:
        os.environ["WANDB_MODE"] = "offline"
    offline = os.environ.get("WANDB_MODE") == "offline"
    if offline:
        log.info("W&B: no API key configured, logging offline to %s/wandb (upload later with `wandb sync`)", run_dir)
    run_id = (resume_state or {}).get("wandb_id")
    return WandbLogger(project=cfg.logger.project, save_dir=str(run_dir), group=cfg.experiment or "default",
                       tags=[f"seed={cfg.seed}"], name=f"{cfg.experiment or 'run'}-seed{cfg.seed}",
                       id=run_id, resume="allow" if run_id else None, offline=offline,
                       config=OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
