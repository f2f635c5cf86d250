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
    """The validated TrainConfig of ``python train.py <overrides>``."""
    return to_train_config(composed(overrides, output_dir))
