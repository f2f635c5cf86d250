"""``python train.py [overrides]``: Hydra entry point, and ``train(cfg)`` that tests call directly."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import hydra
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from textrl.config import CONF_DIR, TrainConfig, register_configs, to_train_config, validate
from textrl.policy.model import build_policy
from textrl.training.callbacks import AtomicCheckpointIO, TemperatureSchedule
from textrl.training.datamodule import RolloutDataModule
from textrl.training.module import PPOModule

log = logging.getLogger(__name__)
register_configs()


class CheckpointError(ValueError):
    pass


def check_checkpoint(path: str) -> Path:
    """Fail before any model is built if the checkpoint cannot be resumed from."""
    ckpt = Path(path).expanduser()
    if not ckpt.is_file():
        raise CheckpointError(f"ckpt_path={path} does not exist; pass a file such as <run>/checkpoints/last.ckpt")
    try:
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"ckpt_path={path} is not a readable checkpoint ({type(exc).__name__}: {exc}); "
                              f"it may be truncated: use another one, e.g. the run's best-*.ckpt") from exc
    missing = [k for k in ("state_dict", "optimizer_states", "textrl") if k not in state]
    if missing:
        raise CheckpointError(f"ckpt_path={path} is not a textrl training checkpoint (missing {missing})")
    return ckpt


def make_logger(cfg: TrainConfig, run_dir: Path, resume_state: dict | None):
    name = cfg.logger.name
    if name == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=run_dir, name="", version="logs")
    if name == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        return TensorBoardLogger(save_dir=run_dir, name="", version="logs")
    from lightning.pytorch.loggers import WandbLogger

    if not os.environ.get("WANDB_API_KEY") and os.environ.get("WANDB_MODE") is None:
        os.environ["WANDB_MODE"] = "offline"
    if os.environ.get("WANDB_MODE") == "offline":
        log.info("W&B: no API key configured, logging offline to %s/wandb (upload later with `wandb sync`)", run_dir)
    run_id = (resume_state or {}).get("wandb_id")
    return WandbLogger(project=cfg.logger.project, save_dir=str(run_dir), group=cfg.experiment or "default",
                       tags=[f"seed={cfg.seed}"], name=f"{cfg.experiment or 'run'}-seed{cfg.seed}",
                       id=run_id, resume="allow" if run_id else None,
                       offline=os.environ.get("WANDB_MODE") == "offline",
                       config=OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))


class WandbIdCallback(L.Callback):
    """Keeps the W&B run id in checkpoints so a resumed run continues the same W&B run."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        logger = trainer.logger
        if logger is not None and type(logger).__name__ == "WandbLogger":
            checkpoint["textrl"]["wandb_id"] = logger.experiment.id


def train(cfg: DictConfig | TrainConfig) -> dict:
    """Train with a composed config; returns the final metrics and the run's paths."""
    cfg = validate(cfg) if isinstance(cfg, TrainConfig) else to_train_config(cfg)
    resume_state = None
    run_dir = Path(cfg.output_dir)
    if cfg.ckpt_path:
        ckpt = check_checkpoint(cfg.ckpt_path)
        resume_state = torch.load(ckpt, map_location="cpu", weights_only=False)["textrl"]
        run_dir = ckpt.parent.parent  # continue the same run directory: logs, checkpoints, transcripts
        cfg.output_dir = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    L.seed_everything(cfg.seed, workers=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)

    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty, cfg.cache_dir)
    module = PPOModule(cfg, policy, tokenizer)
    datamodule = RolloutDataModule(cfg)
    checkpoints = run_dir / "checkpoints"
    last = ModelCheckpoint(dirpath=checkpoints, save_last=True, save_top_k=0, every_n_epochs=1)
    best = ModelCheckpoint(dirpath=checkpoints, filename="best-{iteration:.0f}", monitor="eval/win_rate",
                           mode="max", save_top_k=1, auto_insert_metric_name=False)
    trainer = L.Trainer(
        max_epochs=cfg.iterations,
        accelerator=cfg.trainer.accelerator, devices=cfg.trainer.devices, strategy=cfg.trainer.strategy,
        num_nodes=cfg.trainer.num_nodes, precision=cfg.memory.precision,
        logger=make_logger(cfg, run_dir, resume_state),
        callbacks=[last, best, TemperatureSchedule(cfg.ppo.temperature, cfg.ppo.temperature_decay,
                                                   cfg.ppo.temperature_min), WandbIdCallback()],
        plugins=[AtomicCheckpointIO()],
        check_val_every_n_epoch=cfg.eval.every, num_sanity_val_steps=0, log_every_n_steps=1,
        default_root_dir=run_dir, use_distributed_sampler=False, enable_model_summary=False,
    )
    if resume_state is None:
        trainer.validate(module, datamodule=datamodule, verbose=False)  # iteration 0: the untrained policy
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(cfg.ckpt_path) if cfg.ckpt_path else None)
    if cfg.iterations % cfg.eval.every:
        trainer.validate(module, datamodule=datamodule, verbose=False)  # always evaluate the final policy
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {"metrics": metrics, "run_dir": run_dir, "last": last.last_model_path,
            "best": best.best_model_path, "module": module, "trainer": trainer}


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> None:
    result = train(cfg)
    log.info("done: %s", {k: round(v, 4) for k, v in result["metrics"].items() if k.startswith("eval/")})
