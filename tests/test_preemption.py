"""A run stopped by a signal finishes its iteration, writes its last.ckpt and exits non-zero; started
again in its run directory it resumes by itself, and once finished it has nothing to do. Real tiny
model, real games, `python train.py` as a scheduler runs it."""

import logging
import os
import signal
import subprocess
import sys
import time

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir

import textrl.cli.train as cli
from tests.conftest import SMALL, config, read_metrics, table
from textrl.config import CONF_DIR
from textrl.policy.checkpoint import load
from textrl.training.callbacks import Interrupted

# short iterations (a few seconds), one evaluation after the last
FAST = ["env.max_steps=3", "ppo.epochs=1", "eval.before_training=false", "eval.transcripts=0"]
COMMON = ["iterations=3", "eval.every=3", *FAST]


def test_sigterm_mid_iteration_saves_it_exits_non_zero_and_the_same_command_resumes(tmp_path):
    """`python train.py` gets SIGTERM as iteration 2 starts: it finishes the iteration in progress,
    writes its last.ckpt and exits 143 (128 + SIGTERM), not 0 as if it had finished; the same command started
    again (same hydra.run.dir, no ckpt_path) resumes by itself and ends with the weights and the
    metrics of a run that was never interrupted."""
    straight = cli.train(config(tmp_path / "straight", *COMMON))
    run = tmp_path / "run"
    last = run / "checkpoints" / "last.ckpt"
    command = [sys.executable, "train.py", *SMALL, "memory=none", *COMMON, f"hydra.run.dir={run}"]
    with open(tmp_path / "first.log", "w") as out:
        proc = subprocess.Popen(command, cwd=CONF_DIR.parent, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while not last.is_file() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # iteration 1's checkpoint is written: into iteration 2 (about a second here)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=600)
    first = (tmp_path / "first.log").read_text()
    assert code == 128 + signal.SIGTERM, first[-3000:]
    done = load(last)["textrl"]["iterations_done"]  # the iteration in progress, saved whole
    assert done in (1, 2) and f"stopped by SIGTERM after iteration {done} of 3" in first

    again = subprocess.run(command, cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {last}: {done} of 3 iterations done" in again.stdout + again.stderr
    a = straight["module"].policy.state_dict()
    b = {k.removeprefix("policy."): v for k, v in load(last)["state_dict"].items() if k.startswith("policy.")}
    assert load(last)["textrl"]["iterations_done"] == 3 and set(a) == set(b)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert table(tmp_path / "straight") == table(run)


class SignalAt(L.Callback):
    """Sends this process ``signum`` as iteration ``n``'s training step starts (before its rollout)."""

    def __init__(self, signum, n):
        self.signum, self.n = signum, n

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch + 1 == self.n:
            assert signal.getsignal(self.signum) not in (signal.SIG_DFL, None), "nothing would handle it"
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2], ids=lambda s: s.name)
def test_a_stop_signal_mid_iteration_stops_the_run_after_that_iterations_checkpoint(tmp_path, signum):
    """Lightning's SIGTERM rule, and SIGUSR1/SIGUSR2 (Lightning's and submitit's requeue signals,
    where no launcher handles them), sent as iteration 1's rollout starts."""
    name = signal.Signals(signum).name
    with pytest.raises(Interrupted, match=f"stopped by {name} after iteration 1 of 2; .*last.ckpt holds it"):
        cli.train(config(tmp_path, "iterations=2", "eval.every=2", *FAST), callbacks=[SignalAt(signum, 1)])
    assert load(tmp_path / "checkpoints" / "last.ckpt")["textrl"]["iterations_done"] == 1
    assert signal.getsignal(signum) is signal.SIG_DFL  # handled for as long as the run lasts


def test_a_run_started_again_in_its_directory_resumes_and_a_finished_one_has_nothing_to_do(tmp_path, caplog):
    """Stopped by a signal after iteration 1, then started again in the same directory: the run
    resumes instead of starting over (one row per iteration in metrics.csv); started once more,
    finished, it changes nothing; resume=false starts over."""
    common = ["iterations=2", "eval.every=2", *FAST]
    with pytest.raises(Interrupted, match="stopped by SIGUSR2 after iteration 1 of 2"):
        cli.train(config(tmp_path, *common), callbacks=[SignalAt(signal.SIGUSR2, 1)])
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert load(last)["textrl"]["iterations_done"] == 1

    with caplog.at_level(logging.INFO, logger="textrl.training.run"):
        second = cli.train(config(tmp_path, *common))
    assert f"resuming from {last}: 1 of 2 iterations done" in caplog.text
    assert second["trainer"].current_epoch == 2 and load(last)["textrl"]["iterations_done"] == 2
    trained = [r for r in read_metrics(tmp_path) if r.get("loss/policy")]
    assert [float(r["iteration"]) for r in trained] == [1.0, 2.0]  # continued, not restarted
    assert float(trained[1]["rollout/temperature"]) == pytest.approx(0.995)

    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with caplog.at_level(logging.INFO, logger="textrl.training.run"):
        third = cli.train(config(tmp_path, *common))
    assert "nothing to do" in caplog.text and third["module"] is None and third["last"] == str(last)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files

    with caplog.at_level(logging.INFO, logger="textrl.training.run"):
        cli.train(config(tmp_path, "iterations=1", *common[1:], "resume=false"))
    assert "resume=false: starting over" in caplog.text
    assert load(last)["textrl"]["iterations_done"] == 1


def test_slurm_jobs_that_reach_their_time_limit_are_requeued_and_resume():
    """sweep=slurm: submitit requeues a job on SIGUSR2 before its time limit (the requeued job then
    resumes from its run directory's last.ckpt), which max_num_timeout=0 refused."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["sweep=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.max_num_timeout >= 1 and 0 < launcher.signal_delay_s < launcher.timeout_min * 60
    assert cfg.resume is True
