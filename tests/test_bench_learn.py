"""bench/learn.py adds seeds to a result file only when they are runs of one configuration, and
goes on with a stopped run only where its minutes, overrides and precision stay one run's."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from learn import earlier_runs, run_sessions  # noqa: E402  (bench/ is a script directory, not a package)

OVERRIDES = ["ppo.explore=0.1"]
RUN = ["experiment=medium_rl_rule_cpu", "seed=1"]  # a seed run's overrides


def _file(tmp_path, runs, threads=(1,)):
    path = tmp_path / "learn_easy12_explore.json"
    path.write_text(json.dumps({"overrides": OVERRIDES, "runs": runs, "torch_threads": threads,
                                "command": "python bench/learn.py"}))
    return path


def test_seeds_of_the_same_resolved_config_pool_and_a_changed_default_is_refused(tmp_path):
    old = {"env": {"goal_last": False, "num_envs": 16}, "ppo": {"explore": 0.1}}
    new = {"env": {"goal_last": True, "num_envs": 16}, "ppo": {"explore": 0.1}}
    path = _file(tmp_path, [{"seed": 1, "commit": "e0f07bb", "resolved": old, "threads": 1}])

    runs, commands = earlier_runs(path, OVERRIDES, {2}, old)
    assert [r["seed"] for r in runs] == [1] and commands == ["python bench/learn.py"]
    assert earlier_runs(path, OVERRIDES, {1}, old) == ([], [])  # the seed run again replaces its run

    with pytest.raises(SystemExit, match=r"env\.goal_last differ"):
        earlier_runs(path, OVERRIDES, {2}, new)
    assert earlier_runs(path, ["ppo.explore=0.2"], {2}, new) == ([], [])  # another configuration: replaced


def test_runs_recorded_before_their_resolved_config_still_pool(tmp_path):
    path = _file(tmp_path, [{"seed": 1, "commit": None}], threads=2)  # files of then: one threads figure
    runs, _ = earlier_runs(path, OVERRIDES, {2}, {"env": {"goal_last": True}})
    assert runs[0]["seed"] == 1 and runs[0]["threads"] == 2


def _stopped_run(run_dir, started, ckpt_after):
    """A run folder as bench/learn.py leaves it when its train.py is killed: one stretch with no
    seconds, and a last.ckpt written ``ckpt_after`` seconds into it."""
    (run_dir / "checkpoints").mkdir(parents=True)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(b"weights")
    os.utime(ckpt, (started + ckpt_after, started + ckpt_after))
    (run_dir / "learn_sessions.json").write_text(json.dumps(
        [{"started": started, "seconds": None, "commit": "aaa", "precision": "32-true", "overrides": RUN}]))


def test_a_resumed_run_counts_its_killed_stretch_until_its_last_checkpoint(tmp_path):
    run_dir = tmp_path / "seed1"
    started = time.time() - 7200
    _stopped_run(run_dir, started, ckpt_after=3000.0)
    sessions = run_sessions(run_dir, True, "bbb", "32-true", RUN)
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()  # kept: train.py resumes from it
    assert [s["commit"] for s in sessions] == ["aaa", "bbb"]
    assert sessions[0]["seconds"] == 3000.0  # what the kill lost after the checkpoint is not counted
    assert sessions[1]["seconds"] is None and sessions[1]["started"] >= started + 7000
    assert json.loads((run_dir / "learn_sessions.json").read_text()) == sessions


def test_without_resume_a_stopped_run_starts_over(tmp_path):
    run_dir = tmp_path / "seed1"
    _stopped_run(run_dir, time.time() - 60, ckpt_after=30.0)
    sessions = run_sessions(run_dir, False, "bbb", "32-true", RUN)
    assert not (run_dir / "checkpoints").exists() and [s["commit"] for s in sessions] == ["bbb"]


def test_a_resume_on_a_machine_that_would_choose_another_precision_keeps_the_runs(tmp_path):
    run_dir = tmp_path / "seed1"
    _stopped_run(run_dir, time.time() - 60, ckpt_after=30.0)  # ran in 32-true
    sessions = run_sessions(run_dir, True, "bbb", "bf16-mixed", RUN)  # memory=auto here: bf16
    assert [s["precision"] for s in sessions] == ["32-true", "32-true"]  # as train.py keeps its checkpoint's


def test_a_resume_that_would_change_the_overrides_or_cannot_count_minutes_is_refused(tmp_path):
    run_dir = tmp_path / "seed1"
    _stopped_run(run_dir, time.time() - 60, ckpt_after=30.0)
    with pytest.raises(SystemExit, match=r"ran with experiment=medium_rl_rule_cpu seed=1 and would resume with .*iterations=6"):
        run_sessions(run_dir, True, "bbb", "32-true", [*RUN, "iterations=6"])
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()  # refused before anything was removed
    (run_dir / "learn_sessions.json").unlink()  # a folder train.py wrote without bench/learn.py
    with pytest.raises(SystemExit, match=r"no learn_sessions.json: it was not started by bench/learn.py"):
        run_sessions(run_dir, True, "bbb", "32-true", RUN)
