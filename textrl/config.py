"""Config schemas and loading of the YAML config groups in ``conf/``."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from textrl.policy.model import ModelConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def _group_file(group: str, name: str) -> Path:
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        choices = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        raise ValueError(f"unknown {group} {name!r}; choose one of {choices}")
    return path


def load_model_config(name: str, **overrides) -> ModelConfig:
    """A ``model`` group option as a validated ModelConfig (unknown keys fail)."""
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(_group_file("model", name)), overrides)
    return OmegaConf.to_object(merged)
