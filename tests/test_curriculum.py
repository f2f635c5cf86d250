"""The curriculum: training games move through env options on the rolling training win rate,
recently lost games are replayed (with or without stages), and a resumed run continues at the same stage. Real games; the
tiny model for the run."""

from __future__ import annotations

import pytest

import textrl.cli.train as cli
from textrl.config import ConfigError
from textrl.training.curriculum import Curriculum
from textrl.training.datamodule import RolloutDataModule
from tests.conftest import StopAfter, config, read_metrics

STAGES = ["curriculum.stages=[easy,medium]", "env.goal_last=true"]


def ready(cfg) -> Curriculum:
    curriculum = Curriculum(cfg)
    curriculum.generate()
    return curriculum


def test_stage_moves_on_the_rolling_win_rate_and_lost_games_are_replayed(tmp_path):
    cfg = config(tmp_path, *STAGES, "curriculum.threshold=0.5", "curriculum.window=2", "curriculum.replay=0.5")
    c = ready(cfg)
    easy = c.env
    assert (easy.name, easy.max_steps, easy.goal_last) == ("easy", 8, True)
    played = c.games(0)
    first = played.games
    assert len(first) == 4 and set(first) <= set(c.train_games) and played.replayed == 0 and played.env == easy

    lost = [str(first[0]), str(first[1])]
    assert not c.record(0.25, lost)  # a stand-in win rate: one iteration is not a full window
    played = c.games(1)
    assert {str(g) for g in played.games[:2]} == set(lost) and played.replayed == 2  # half the games: lost ones
    assert len(set(played.games)) == 4
    assert not c.record(0.5, [])  # (0.25 + 0.5) / 2 < 0.5
    assert c.record(1.0, [])  # (0.5 + 1.0) / 2 >= 0.5: on to medium
    medium = c.env
    assert (c.stage, medium.name, medium.max_steps, medium.goal_last) == (1, "medium", 32, True)
    played = c.games(3)
    assert "textworld-r3-o4-q3" in str(played.games[0]) and c.lost == [] and played.replayed == 0
    assert played.stage == 1 and played.env.name == "medium"
    assert not c.record(1.0, []) and not c.record(1.0, [])  # the last stage stays
    assert c.stage == 1

    # a checkpoint's state: a fresh curriculum continues with the same stage and the same games
    c.record(0.0, [str(g) for g in c.games(4).games[:3]])
    again = ready(cfg)
    again.load_state_dict(c.state_dict())
    assert again.env.name == "medium"
    assert again.games(5) == c.games(5) and c.games(5).replayed == 2


def test_lost_games_are_replayed_without_stages_by_default_and_not_when_switched_off(tmp_path):
    c = ready(config(tmp_path))  # the default: curriculum.replay=0.25, no stages
    first = c.games(0).games
    assert not c.record(0.0, [str(first[2])] * 2)  # no stage to move to; a game lost twice is one game
    assert c.lost == [str(first[2])]
    again = c.games(1)
    assert again.games[0] == first[2] and again.replayed == 1 and len(set(again.games)) == 4  # a quarter of 4 games
    assert c.stage == 0 and c.stage_win_rates == []

    off = ready(config(tmp_path, "curriculum.replay=0"))
    off.record(0.0, [str(g) for g in off.games(0).games])
    assert off.games(1).replayed == 0
    assert off.games(1) == ready(config(tmp_path, "curriculum.replay=0")).games(1)


def test_evaluation_on_training_games_plays_the_current_stage(tmp_path):
    """The second validation loader (eval.train_games fixed training games) is read when an
    evaluation starts: after a stage move it holds the new stage's games, with the stage's settings."""
    data = RolloutDataModule(config(tmp_path, *STAGES, "curriculum.threshold=0.0", "curriculum.window=1"))
    data.prepare_data()
    data.setup("fit")
    held_out, train = data.val_dataloader()
    games, env = next(iter(train))
    assert env.name == "easy" and len(games) == 2 and set(games) <= set(data.curriculum.train_games)
    assert data.curriculum.record(1.0, [])  # on to medium
    games, env = next(iter(train))
    assert env.name == "medium" and "textworld-r3-o4-q3" in str(games[0])
    assert next(iter(held_out))[1].name == "easy"  # evaluation stays on env


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
