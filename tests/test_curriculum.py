"""The curriculum: training games move through env options on the rolling training win rate,
recently lost games are replayed (with or without stages), and a resumed run continues at the same stage. Real games; the
tiny model for the run."""

from __future__ import annotations

import pytest

import textrl.cli.train as cli
from textrl.config import ConfigError
from textrl.training.datamodule import RolloutDataModule
from tests.conftest import StopAfter, config, read_metrics

STAGES = ["curriculum.stages=[easy,medium]", "env.goal_last=true"]


def ready(cfg) -> RolloutDataModule:
    data = RolloutDataModule(cfg)
    data.prepare_data()
    data.setup("fit")
    return data


def test_stage_moves_on_the_rolling_win_rate_and_lost_games_are_replayed(tmp_path):
    cfg = config(tmp_path, *STAGES, "curriculum.threshold=0.5", "curriculum.window=2", "curriculum.replay=0.5")
    data = ready(cfg)
    easy = data.train_env
    assert (easy.name, easy.max_steps, easy.goal_last) == ("easy", 8, True)
    first = data.games_for_iteration(0)
    assert len(first) == 4 and set(first) <= set(data.train_games) and data.replayed == 0

    lost = [str(first[0]), str(first[1])]
    assert not data.record(0.25, lost)  # a stand-in win rate: one iteration is not a full window
    replayed = data.games_for_iteration(1)
    assert {str(g) for g in replayed[:2]} == set(lost) and data.replayed == 2  # half the games: lost ones
    assert len(set(replayed)) == 4
    assert not data.record(0.5, [])  # (0.25 + 0.5) / 2 < 0.5
    assert data.record(1.0, [])  # (0.5 + 1.0) / 2 >= 0.5: on to medium
    medium = data.train_env
    assert (data.stage, medium.name, medium.max_steps, medium.goal_last) == (1, "medium", 32, True)
    assert "textworld-r3-o4-q3" in str(data.games_for_iteration(3)[0]) and data.lost == [] and data.replayed == 0
    assert not data.record(1.0, []) and not data.record(1.0, [])  # the last stage stays
    assert data.stage == 1

    # a checkpoint's state: a fresh datamodule continues with the same stage and the same games
    data.record(0.0, [str(g) for g in data.games_for_iteration(4)[:3]])
    again = ready(cfg)
    again.load_state_dict(data.state_dict())
    assert again.train_env.name == "medium"
    assert again.games_for_iteration(5) == data.games_for_iteration(5)
    assert again.replayed == data.replayed == 2


def test_lost_games_are_replayed_without_stages_by_default_and_not_when_switched_off(tmp_path):
    data = ready(config(tmp_path))  # the default: curriculum.replay=0.25, no stages
    first = data.games_for_iteration(0)
    assert not data.record(0.0, [str(first[2])] * 2)  # no stage to move to; a game lost twice is one game
    assert data.lost == [str(first[2])]
    again = data.games_for_iteration(1)
    assert again[0] == first[2] and data.replayed == 1 and len(set(again)) == 4  # a quarter of 4 games
    assert data.stage == 0 and data.stage_win_rates == []

    off = ready(config(tmp_path, "curriculum.replay=0"))
    off.record(0.0, [str(g) for g in off.games_for_iteration(0)])
    assert off.replayed == 0 and off.games_for_iteration(1) == ready(config(tmp_path, "curriculum.replay=0")).games_for_iteration(1)


def test_bad_curriculum_is_refused_at_start(tmp_path):
    with pytest.raises(ConfigError, match="curriculum.stages=.*impossible.* is not allowed: env options"):
        config(tmp_path, "curriculum.stages=[easy,impossible]")
    with pytest.raises(ConfigError, match="curriculum.replay=1.0 is not allowed"):
        config(tmp_path, *STAGES, "curriculum.replay=1.0")


def test_a_resumed_run_continues_at_its_stage(tmp_path):
    common = ["iterations=4", "eval.every=2", *STAGES, "curriculum.threshold=0.0", "curriculum.window=2"]
    cli.train(config(tmp_path / "straight", *common))
    cli.train(config(tmp_path / "split", *common), callbacks=[StopAfter(2)])
    cli.train(config(tmp_path / "elsewhere", *common, f"ckpt_path={tmp_path / 'split' / 'checkpoints' / 'last.ckpt'}"))

    def stages(run):
        return [(r["iteration"], r["curriculum/stage"], r["rollout/return"]) for r in read_metrics(run)
                if r.get("curriculum/stage")]

    straight = stages(tmp_path / "straight")
    # threshold 0: the stage moves after its first full window (iterations 1 and 2 on easy)
    assert [s for _, s, _ in straight] == ["0.0", "0.0", "1.0", "1.0"]
    assert stages(tmp_path / "split") == straight  # stopped after 2, resumed: same stages, same episodes
