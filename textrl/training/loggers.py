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
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from omegaconf import OmegaConf

from textrl.config import TrainConfig
from textrl.transcripts import COLUMNS

log = logging.getLogger(__name__)


def write_csv(path: Path, fieldnames: list[str], rows: list[dict]) -> None:
    """Write a CSV file whole: into a temporary file in the same folder, synced, then renamed over
    ``path``, so a crash at any moment leaves the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", newline="") as f:
            out = csv.DictWriter(f, fieldnames=fieldnames)
            out.writeheader()
            out.writerows(rows)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if os.name == "posix":  # the rename itself reaches the disk with its folder
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


class _MetricsWriter(ExperimentWriter):
    """Lightning's CSV writer, except that it keeps the folder's ``metrics.csv`` (Lightning's deletes
    it) and rewrites it whole, through ``write_csv``, when new columns appear."""

    def _check_log_dir_exists(self) -> None:
        pass

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        with open(self.metrics_file_path, newline="") as f:
            rows = list(csv.DictReader(f))
        write_csv(Path(self.metrics_file_path), fieldnames, rows)


class ResumableCSVLogger(CSVLogger):
    """CSVLogger that keeps an existing ``metrics.csv`` (Lightning's deletes it), so a resumed run
    appends to its own history instead of starting a new one. Rows of iterations after
    ``resume_iteration`` (written by a run killed before that iteration's checkpoint) are dropped:
    the resumed run plays those iterations again. Every row is flushed as it is logged
    (Lightning's default keeps 100 steps in memory, which a killed run would lose). The file is
    only ever rewritten whole (``write_csv``): a crash while rewriting it keeps the old one."""

    def __init__(self, *args, resume_iteration: int | None = None, **kwargs):
        super().__init__(*args, flush_logs_every_n_steps=1, **kwargs)
        self.resume_iteration = resume_iteration

    @property
    @rank_zero_experiment
    def experiment(self):
        if self._experiment is not None:
            return self._experiment
        self._fs.makedirs(self.root_dir, exist_ok=True)
        writer = _MetricsWriter(log_dir=self.log_dir)
        path = Path(writer.metrics_file_path)
        if path.is_file():
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                keys = list(reader.fieldnames or [])
                rows = [r for r in reader if self.resume_iteration is None
                        or not r.get("iteration") or float(r["iteration"]) <= self.resume_iteration]
            if keys:
                write_csv(path, keys, rows)
                writer.metrics_keys = keys
        self._experiment = writer
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
