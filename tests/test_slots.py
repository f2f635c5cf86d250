"""trainer.share_machine: a multirun's jobs side by side each hold a slot of the machine of their own."""

import os

import pytest

from tests.test_config import compose_train
from textrl.config import ConfigError
from textrl.training.slots import machine_slot


@pytest.fixture
def keep_affinity():
    cores = os.sched_getaffinity(0)
    yield cores
    os.sched_setaffinity(0, cores)  # a claim pins this (the test) process


def test_each_job_takes_a_free_slot_and_gives_it_back_when_it_ends(tmp_path, keep_affinity):
    jobs = []
    for i in range(len(keep_affinity) + 1):
        cfg = compose_train(["sweep=cpu"])  # threads=1: one slot per core
        cfg.output_dir = str(tmp_path / f"{i}_seed{i}")
        jobs.append(cfg)
    held = [machine_slot(cfg) for cfg in jobs[:-1]]
    slots = [h.__enter__() for h in held]
    assert slots == list(range(len(keep_affinity)))
    assert os.sched_getaffinity(0) == {sorted(keep_affinity)[slots[-1]]}  # pinned to the last slot's core
    with pytest.raises(ConfigError, match=f"all {len(slots)} slots of this machine are taken"):
        with machine_slot(jobs[-1]):
            pass
    held[0].__exit__(None, None, None)  # the first job ends: its slot is free again
    with machine_slot(jobs[-1]) as slot:
        assert slot == 0
    for h in held[1:]:
        h.__exit__(None, None, None)


def test_share_machine_on_cpus_needs_threads(tmp_path):
    cfg = compose_train(["sweep=cpu", "threads=null"])
    cfg.output_dir = str(tmp_path / "0_seed1")
    with pytest.raises(ConfigError, match="needs threads=T, the cores each job uses"):
        with machine_slot(cfg):
            pass


def test_share_machine_gives_one_device_per_job():
    with pytest.raises(ConfigError, match="trainer.share_machine=True is not allowed: true only with trainer.devices=1"):
        compose_train(["sweep=cpu", "trainer.devices=2"])


@pytest.mark.parametrize("option, launcher", [("cpu", "JoblibLauncher"), ("gpus", "JoblibLauncher"),
                                              ("slurm", "SlurmLauncher")])
def test_each_sweep_option_picks_its_hydra_launcher(option, launcher):
    from hydra import compose, initialize_config_dir

    from textrl.config import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"sweep={option}"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith(launcher)
    if option == "cpu":
        assert cfg.hydra.launcher.n_jobs == 2 and cfg.threads == 1 and cfg.trainer.share_machine
