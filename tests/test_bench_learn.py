"""bench/learn.py adds seeds to a result file only when they are runs of one configuration."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from learn import earlier_runs  # noqa: E402  (bench/ is a script directory, not a package)

OVERRIDES = ["ppo.explore=0.1"]


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
