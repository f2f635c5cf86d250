"""The run of ``python train.py``: ``train(cfg)``, which tests and benchmarks call directly.

In order: the config validated; the checkpoint it resumes from, or the one it starts from
(``model.init_from``), read and checked; every game made; the policy built; the config resolved
with what the built policy says (``textrl.config.resolve``: the precision, the prompt's budget
within its positions), the one step after which nothing writes to a config; the warm start, the
module, the Trainer, and the fit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from textrl.config import ModelFacts, TrainConfig, resolve, to_train_config, validate
from textrl.games.pool import check_games
from textrl.policy.checkpoint import (CheckpointError, check_resumable, check_same_model, frozen_fingerprint,
                                      leaves_frozen_weights_out, load_policy_weights, read_checkpoint, stored_config)
from textrl.policy.device import trainer_device
from textrl.policy.model import PolicyValueModel, build_policy
from textrl.policy.speed import AUTO_PRECISION_ENV, PRECISIONS, choose_precision
from textrl.training.callbacks import AtomicCheckpointIO, EvaluateLastIteration, Interrupted, StopOnSignal
from textrl.training.curriculum import generate_games
from textrl.training.datamodule import RolloutDataModule
from textrl.training.loggers import WandbIdCallback, make_logger
from textrl.training.module import PPOModule
from textrl.training.slots import machine_slot, on_slot
from textrl.training.warm_start import warm_start

log = logging.getLogger(__name__)


def train(cfg: DictConfig | TrainConfig, callbacks: list[L.Callback] = ()) -> dict:
    """Train with a composed config; returns the final metrics and the run's paths.

    ``callbacks`` are added to the Trainer's (tests use one to stop a run part-way).
    """
    cfg = validate(cfg) if isinstance(cfg, TrainConfig) else to_train_config(cfg)
    check_games(cfg)  # a bad game family or setting fails here, naming its key, before anything is built
    with machine_slot(cfg) as slot:  # a GPU or a group of cores of its own, when jobs share the machine
        return _train(on_slot(cfg, slot), callbacks)


def _train(cfg: TrainConfig, callbacks: list[L.Callback]) -> dict:
    cfg, resume_state = resume(cfg)  # before anything is built; a resumed run continues in its own directory
    resume_iteration = resume_state["iterations_done"] if resume_state is not None else None
    if resume_iteration is not None and resume_iteration >= cfg.iterations:
        return _finished(cfg, Path(cfg.output_dir), resume_iteration)
    # read and checked before anything is built; handed on in a dict that _build_and_fit empties, so
    # that the checkpoint's tensors are freed once loaded
    init = {"state": init_from(cfg)} if cfg.model.init_from and resume_state is None else {}
    # every game the run can play (env's and every curriculum stage's training pools, the warm
    # start's, the evaluation games), made now: before anything touches CUDA, since the generating
    # workers are forked (textrl.games.pool.start_method), and never mid-run
    start = time.perf_counter()
    generate_games(cfg)
    log.info("games ready in %.1f s: every game this run plays is in the cache", time.perf_counter() - start)
    try:
        with deterministic(cfg.trainer.deterministic), job_gpu(cfg):
            return _build_and_fit(cfg, callbacks, resume_state, init)
    finally:
        os.environ.pop(AUTO_PRECISION_ENV, None)  # a sweep worker's next job decides its own


def _build_and_fit(cfg: TrainConfig, callbacks: list[L.Callback], resume_state: dict | None, init: dict) -> dict:
    """The rest of ``_train``, once the games are made: the policy, the resolved config, the warm
    start, the module, the Trainer and the fit."""
    init_state = init.pop("state", None)
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    L.seed_everything(cfg.seed, workers=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = trainer_device(cfg.trainer)
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty, cfg.cache_dir, cfg.memory, device)
    # decided here, before the warm start, the module and the Trainer read the config; the random
    # state is untouched. A resumed run keeps the precision it trained with (its checkpoint's); DDP's
    # other ranks, which Lightning starts with this process's environment, take this rank's decision
    # instead of measuring on cores the ranks share (they could decide otherwise)
    decided = ((resume_state or {}).get("config", {}).get("memory", {}).get("precision")
               or os.environ.get(AUTO_PRECISION_ENV))
    cfg = resolve(cfg, model_facts(cfg, policy, device, decided))  # nothing writes to a config after this
    os.environ[AUTO_PRECISION_ENV] = cfg.memory.precision  # for the ranks fit() starts; removed by _train
    if cfg.memory.name == "auto" and device.type == "cuda":  # decided by resolve, as the GPU computes bf16
        log.info("memory=auto: precision %s (%s)", cfg.memory.precision,
                 "native bf16 on this GPU" if cfg.memory.precision == "bf16-mixed" else "no native bf16 on this GPU")
    # each stage's prompt within the positions too; the games made by _train, read from the cache
    datamodule = RolloutDataModule(cfg, policy.position_limit, games_made=True)
    datamodule.prepare_data()
    frozen_as_built = _load_init(cfg, policy, init_state)
    del init_state
    # behaviour cloning on walkthroughs, before the module: iteration 0's evaluation and a KL
    # anchor's reference are the warm-started policy
    warm = warm_start(policy, tokenizer, cfg) if cfg.warm_start.steps and resume_state is None else None
    if warm:
        (run_dir / "warm_start.json").write_text(json.dumps(warm, indent=2) + "\n")
    module = PPOModule(cfg, policy, tokenizer, frozen_as_built)
    trainer, last, best, stop = _trainer(cfg, run_dir, resume_state, callbacks)
    if warm and trainer.logger is not None:
        trainer.logger.log_metrics({**warm, "iteration": 0.0}, step=0)
    with stop.listening():  # SIGTERM (SIGUSR1/2): stop after the current iteration's last.ckpt
        try:
            _fit(cfg, trainer, module, datamodule, resume_state is None)
            done = trainer.current_epoch >= cfg.iterations
        except SIGTERMException:  # Lightning's own stop on SIGTERM, after an iteration's end or before its start
            stop.signum = signal.SIGTERM
            done = 0 < cfg.iterations <= trainer.current_epoch
    if stop.signum is not None and not done:
        raise Interrupted(stop.signum, trainer.current_epoch, cfg.iterations, run_dir)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if cfg.iterations == 0:
        return {"metrics": metrics, "run_dir": run_dir, "last": str(run_dir / "checkpoints" / "warm_start.ckpt"),
                "best": "", "module": module, "trainer": trainer}
    return {"metrics": metrics, "run_dir": run_dir, "last": last.best_model_path,
            "best": best.best_model_path, "module": module, "trainer": trainer}


def model_facts(cfg: TrainConfig, policy: PolicyValueModel, device: torch.device, decided: str | None) -> ModelFacts:
    """What ``resolve`` needs of the built policy: its positions, and a CPU's ``memory.precision=auto``:
    ``decided`` where a decision was handed down (a resumed run's checkpoint, DDP's rank 0), else the
    faster of fp32 and bf16 on this model's layer shapes (``choose_precision``: measured once per
    machine and cached; logged with both figures)."""
    def cpu_precision() -> str:
        if decided in PRECISIONS:
            log.info("memory=auto: precision %s, as this run decided before (its checkpoint, or DDP's rank 0)", decided)
            return decided
        choice = choose_precision(policy, device, cfg.cache_dir)
        log.info("memory=%s: %s", cfg.memory.name, choice.describe())  # names both figures and the choice
        return choice.precision

    return ModelFacts(policy.position_limit, cpu_precision)


def _load_init(cfg: TrainConfig, policy: PolicyValueModel, init_state: dict | None) -> bool:
    """``model.init_from``'s weights into ``policy`` (before the module: a KL anchor's reference is
    this policy). Returns whether the frozen weights are as built: checkpoints may leave them out
    (they come from the model config)."""
    if init_state is None:
        return True
    slim = leaves_frozen_weights_out(cfg)
    built = frozen_fingerprint(policy) if slim else None
    load_policy_weights(policy, init_state, cfg.memory.lora, f"model.init_from={cfg.model.init_from}")
    return not slim or frozen_fingerprint(policy) == built


def _trainer(cfg: TrainConfig, run_dir: Path, resume_state: dict | None,
             callbacks: list[L.Callback]) -> tuple[L.Trainer, ModelCheckpoint, ModelCheckpoint, StopOnSignal]:
    """The Trainer, with its last and best checkpoints and the signal handler that stops it."""
    resume_iteration = resume_state["iterations_done"] if resume_state is not None else None
    # last.ckpt after every iteration, overwritten in place (a "top-1 without a monitor" is the most
    # recent one). Lightning's save_last=True alone writes it only when another checkpoint is saved
    # in the same step, which with eval.every > 1 means at the end of training.
    last = ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="last", save_top_k=1, every_n_epochs=1,
                           save_on_train_epoch_end=True, enable_version_counter=False)
    best = ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="best-{iteration:.0f}", monitor="eval/win_rate",
                           mode="max", save_top_k=1, auto_insert_metric_name=False)
    stop = StopOnSignal()
    trainer = L.Trainer(
        max_epochs=cfg.iterations,
        accelerator=cfg.trainer.accelerator, devices=cfg.trainer.devices, strategy=cfg.trainer.strategy,
        num_nodes=cfg.trainer.num_nodes, precision=cfg.memory.precision,
        logger=make_logger(cfg, run_dir, resume_state, resume_iteration),
        callbacks=[last, best, EvaluateLastIteration(), WandbIdCallback(), stop, *callbacks],
        plugins=[AtomicCheckpointIO()],
        check_val_every_n_epoch=cfg.eval.every, num_sanity_val_steps=0, log_every_n_steps=1,
        default_root_dir=run_dir, use_distributed_sampler=False, enable_model_summary=False,
        # None leaves torch's flags as `deterministic` set them (False would switch off a caller's own)
        deterministic=cfg.trainer.deterministic or None,
    )
    return trainer, last, best, stop


@contextlib.contextmanager
def deterministic(on: bool):
    """``trainer.deterministic``: deterministic algorithms for the whole run, the warm start's
    Fabric included, set before anything touches CUDA (cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` when
    it first runs; Lightning's Trainer, which sets the same, is built after the warm start). Resuming
    on CUDA is exact only with it; some CUDA ops are slower, and those with no deterministic kernel
    raise (``torch.use_deterministic_algorithms``). Restored afterwards: a process that runs several
    jobs (tests, Hydra's joblib workers) does not carry one job's mode into the next."""
    if not on:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # as Lightning sets it
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = before[2]
        if before[3] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = before[3]


@contextlib.contextmanager
def job_gpu(cfg: TrainConfig):
    """On CUDA, this job's GPU (``process_device``'s) for the whole run: current device (stray
    allocations and the CUDA context go there, not to GPU 0) and its peak-memory counter reset at
    the start (``perf/peak_mem_gb`` is this job's peak). Entered after the games are made: setting
    the device initialises CUDA. The memory the run held is given back by ``textrl.cli.train.run_job``,
    once nothing refers to it. (Fork-started DDP is refused on a GPU: ``textrl.config``.) Not tested
    here: no GPU (read only)."""
    device = trainer_device(cfg.trainer)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    yield


def _fit(cfg: TrainConfig, trainer: L.Trainer, module: PPOModule, datamodule: RolloutDataModule, fresh: bool) -> None:
    """Iteration 0's evaluation (a ``fresh`` run), then the iterations, or a warm start's checkpoint."""
    if fresh and (cfg.eval.before_training or cfg.iterations == 0):
        trainer.validate(module, datamodule=datamodule, verbose=False)  # iteration 0: the starting policy
        module.train()  # validate() leaves the modules in eval mode
    if cfg.iterations == 0:  # a warm start alone: its policy as a checkpoint that model.init_from reads
        trainer.save_checkpoint(Path(cfg.output_dir) / "checkpoints" / "warm_start.ckpt")
        return
    # evaluations after every eval.every-th iteration and after the last (EvaluateLastIteration), all
    # inside fit: each is logged as one eval row and judged by `best`
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(cfg.ckpt_path) if cfg.ckpt_path else None)


def resume(cfg: TrainConfig) -> tuple[TrainConfig, dict | None]:
    """The run's config and the textrl state of the checkpoint it continues from, read and checked
    before anything is built: ``ckpt_path``, else (``resume``, the default) the run directory's own
    ``checkpoints/last.ckpt`` (a requeued job, or ``python train.py hydra.run.dir=DIR`` again). A
    resumed run's config has ``output_dir`` at the checkpoint's run directory and ``ckpt_path`` at it."""
    last = Path(cfg.output_dir) / "checkpoints" / "last.ckpt"
    auto = not cfg.ckpt_path and last.is_file()
    if auto and not cfg.resume:
        log.warning("resume=false: starting over in %s, whose checkpoints are replaced and whose logs are appended "
                    "to (another hydra.run.dir keeps the runs apart)", cfg.output_dir)
        return cfg, None
    ckpt_path = str(last) if auto else cfg.ckpt_path
    if not ckpt_path:
        return cfg, None
    ckpt, state = read_checkpoint(ckpt_path)
    over = "; resume=false starts this run over" if auto else ""
    if "iterations_done" not in state["textrl"]:
        raise CheckpointError(f"ckpt_path={ckpt_path} was written by an older textrl and cannot be resumed "
                              f"exactly; textrl-eval and textrl-play still read it{over}")
    check_resumable(state, f"ckpt_path={ckpt_path}", over)
    check_same_model(cfg, state, f"ckpt_path={ckpt_path}", "A run resumes with the model and memory options it "
                     f"was trained with (its .hydra/overrides.yaml){over}")
    # the KL anchor's reference policy is a buffer of the checkpoint, or absent: a run started without
    # it and resumed with it would anchor, silently, to the weights it is built with instead of its
    # initial policy
    trained = stored_config(state).ppo.kl_coef
    if (trained > 0) != (cfg.ppo.kl_coef > 0):
        raise CheckpointError(f"ckpt_path={ckpt_path} was trained with ppo.kl_coef={trained:g}; this run has "
                              f"ppo.kl_coef={cfg.ppo.kl_coef:g}, so its KL anchor's reference policy "
                              f"{'is not' if trained == 0 else 'is'} in the checkpoint. Resume with "
                              f"ppo.kl_coef={trained:g} (its .hydra/overrides.yaml){over}")
    log.info("resuming from %s: %d of %d iterations done%s", ckpt, state["textrl"]["iterations_done"],
             cfg.iterations, " (resume=false starts over)" if auto else "")
    # the same run directory: logs, checkpoints, transcripts
    return replace(cfg, ckpt_path=ckpt_path, output_dir=str(ckpt.parent.parent)), state["textrl"]


def _finished(cfg: TrainConfig, run_dir: Path, done: int) -> dict:
    """Started again when all its iterations are done (a job requeued after its last checkpoint):
    nothing to train."""
    log.info("nothing to do: %s holds %d iterations, iterations=%d. To train its policy further, start a new "
             "run from it: model.init_from=%s", cfg.ckpt_path, done, cfg.iterations, cfg.ckpt_path)
    best = sorted((run_dir / "checkpoints").glob("best-*.ckpt"))
    return {"metrics": {}, "run_dir": run_dir, "last": str(cfg.ckpt_path), "best": str(best[-1]) if best else "",
            "module": None, "trainer": None}


def init_from(cfg: TrainConfig) -> dict:
    """The checkpoint of ``model.init_from``, read and checked against this run's model before
    anything is built."""
    _, state = read_checkpoint(cfg.model.init_from, "model.init_from")
    check_same_model(cfg, state, f"model.init_from={cfg.model.init_from}",
                     "Use the same model and memory option, or export it (textrl-export CKPT DIR) and train from "
                     "the directory: model.source=hub model.path=DIR")
    return state
