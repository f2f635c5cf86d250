"""The training config a benchmark measures: what ``python train.py <overrides>`` composes.

Kept in ``bench/`` and built only on ``textrl.config`` names every commit has, so that a benchmark
of this tree can also run against an older commit's package (``PYTHONPATH=<tree>``, the A/B
protocol of ``bench/iteration.py``).
"""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from textrl.config import CONF_DIR, register_configs, to_train_config


def composed(overrides: list[str], output_dir: str = "unused") -> DictConfig:
    """The raw composed config (unvalidated); ``output_dir`` stands in for the run directory Hydra
    would create."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=[*overrides, f"output_dir={output_dir}"])


def train_config(overrides: list[str], output_dir: str = "unused"):
    """The validated TrainConfig of ``python train.py <overrides>``, with ``memory.precision=auto``
    (and ``ppo.recompute_old=null``) decided as ``train`` decides them: on a CPU, ``resolve`` leaves
    them to a measurement on the built model, which is built here for that (the decision is cached
    per machine, so the run that the benchmark then starts reads the same one). An older commit's
    ``resolve`` decides them itself, and nothing here runs."""
    cfg = to_train_config(composed(overrides, output_dir))
    if cfg.memory.precision == "auto":
        import torch

        from textrl.policy.device import trainer_device
        from textrl.policy.model import build_policy

        threads = torch.get_num_threads()
        if cfg.threads:  # measured with the run's threads: part of the decision's key
            torch.set_num_threads(cfg.threads)
        try:
            device = trainer_device(cfg.trainer)
            policy, _ = build_policy(cfg.model, cfg.env.step_penalty, cfg.cache_dir, cfg.memory, device)
            cfg, choice = _decided(cfg, policy, device)
            print(f"memory={cfg.memory.name}: {choice.describe()}", flush=True)
        finally:
            torch.set_num_threads(threads)
    return cfg


def _decided(cfg, policy, device):
    """``cfg`` with ``memory.precision=auto`` (and ``ppo.recompute_old``) decided on ``policy`` as
    ``train`` decides them, and the choice: ``resolve`` with the model's facts (its positions left
    out: the prompt budget stays the config's), or an older tree's in-place decision."""
    try:
        from textrl.config import ModelFacts, resolve
    except ImportError:  # a tree whose resolve takes no model facts decides in place
        from textrl.policy.precision import resolve_auto_precision

        return cfg, resolve_auto_precision(cfg, policy, device)
    from textrl.policy.speed.precision import choose_precision

    choices = []

    def measured() -> str:
        choices.append(choose_precision(policy, device, cfg.cache_dir))
        return choices[-1].precision

    return resolve(cfg, ModelFacts(None, measured)), choices[0]
