"""The ``logger`` config group: csv, tensorboard or wandb, each continuing its run on resume."""

from __future__ import annotations

import csv
import hashlib
import logging
import netrc
import os
from pathlib import Path
from urllib.parse import urlparse

import lightning as L
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from omegaconf import OmegaConf

from textrl.config import TrainConfig
from textrl.transcripts import COLUMNS

log = logging.getLogger(__name__)


class ResumableCSVLogger(CSVLogger):
    """CSVLogger that keeps an existing ``metrics.csv`` (Lightning's deletes it), so a resumed run
    appends to its own history instead of starting a new one. Rows of iterations after
    ``resume_iteration`` (written by a run killed before that iteration's checkpoint) are dropped:
    the resumed run plays those iterations again. Every row is flushed as it is logged
    (Lightning's default keeps 100 steps in memory, which a killed run would lose)."""

    def __init__(self, *args, resume_iteration: int | None = None, **kwargs):
        super().__init__(*args, flush_logs_every_n_steps=1, **kwargs)
        self.resume_iteration = resume_iteration

    @property
    def experiment(self):
        if self._experiment is not None:
            return self._experiment
        path = Path(self.log_dir) / "metrics.csv"
        rows, keys = [], []
        if path.is_file():
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                keys = list(reader.fieldnames or [])
                rows = [r for r in reader if self.resume_iteration is None
                        or not r.get("iteration") or float(r["iteration"]) <= self.resume_iteration]
        writer = super().experiment
        if keys:
            with open(path, "w", newline="") as f:
                out = csv.DictWriter(f, fieldnames=keys)
                out.writeheader()
                out.writerows(rows)
            writer.metrics_keys = keys
        return writer


class WandbIdCallback(L.Callback):
    """Keeps the W&B run id in checkpoints so a resumed run continues the same W&B run."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if type(trainer.logger).__name__ == "WandbLogger":
            checkpoint.setdefault("textrl", {})["wandb_id"] = trainer.logger.experiment.id


def wandb_api_key() -> str | None:
    """The W&B key the way wandb finds it: $WANDB_API_KEY, else the netrc entry `wandb login`
    writes for the W&B host ($NETRC or ~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return os.environ["WANDB_API_KEY"]
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc")).expanduser()
    try:
        entry = netrc.netrc(str(path)).authenticators(host) if path.is_file() else None
    except (netrc.NetrcParseError, OSError) as exc:
        log.warning("W&B: cannot read %s (%s)", path, exc)
        return None
    return entry[2] if entry else None


def configuration(overrides: list[str]) -> str:
    """What a run's configuration is called: its command-line overrides without ``seed=`` (the seeds
    of one configuration share the name) and without those that change where and how fast a run
    goes or where it logs, not what it learns (``threads=``, ``sweep=``, ``logger=``).
    ``textrl-report`` groups runs by it; W&B groups by it (``wandb_group``)."""
    ignored = ("seed=", "threads=", "sweep=", "logger=")
    return " ".join(o for o in overrides if not o.startswith(ignored)) or "defaults"


def wandb_group(cfg: TrainConfig) -> str:
    """The W&B group of a run: its configuration (Hydra's overrides for this job, as textrl-report
    groups), so W&B's grouped view shows each configuration's seeds as one line with a band. Runs
    started from code (no Hydra) group by their experiment name. W&B allows 128 characters: a
    longer name keeps its start and a hash of the whole."""
    if HydraConfig.initialized():
        group = configuration(list(HydraConfig.get().overrides.task))
    else:
        group = cfg.experiment or "defaults"
    if len(group) > 128:
        group = group[:119] + "~" + hashlib.sha256(group.encode()).hexdigest()[:8]
    return group


def make_logger(cfg: TrainConfig, run_dir: Path, resume_state: dict | None, resume_iteration: int | None = None):
    name = cfg.logger.name
    if name == "csv":
        return ResumableCSVLogger(save_dir=run_dir, name="", version="logs", resume_iteration=resume_iteration)
    if name == "tensorboard":
        return TensorBoardLogger(save_dir=run_dir, name="", version="logs")  # event files append
    mode = os.environ.get("WANDB_MODE")
    offline = mode == "offline" or (mode is None and not wandb_api_key())
    if offline and mode is None:
        log.info("W&B: no API key ($WANDB_API_KEY or `wandb login`), logging offline to %s/wandb "
                 "(upload later with `wandb sync`)", run_dir)
    run_id = (resume_state or {}).get("wandb_id")
    return WandbLogger(project=cfg.logger.project, save_dir=str(run_dir), group=wandb_group(cfg),
                       tags=[f"seed={cfg.seed}"], name=f"{cfg.experiment or 'run'}-seed{cfg.seed}",
                       id=run_id, resume="allow" if run_id else None, offline=offline,
                       config=OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))


def log_transcripts(logger, rows: list[list], markdown: str, iteration: int) -> None:
    """An evaluation's transcripts where its curves are: a W&B Table (one row per step, columns
    ``textrl.transcripts.COLUMNS``; each evaluation is a new version of the ``eval/transcripts``
    table) or TensorBoard text (the Markdown, under the iteration). The csv logger has the Markdown
    files in ``transcripts/`` only."""
    if isinstance(logger, WandbLogger):
        logger.log_table("eval/transcripts", columns=COLUMNS, data=rows)
    elif isinstance(logger, TensorBoardLogger):
        logger.experiment.add_text("eval/transcripts", markdown, global_step=iteration)
