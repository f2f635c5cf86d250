"""textrl-eval and textrl-play on held-out games: a random policy and a trained tiny checkpoint."""

import json
import math
import re
from pathlib import Path

import pytest

import textrl.cli.train as cli
from textrl.cli.evaluate import main
from textrl.results import wilson_interval
from textrl.cli.play import main as play_main
from tests.conftest import config

HEADER = re.compile(r"^## (\S+): (won|not won \(\w+\)) in (\d+) steps, return ([-+]\d+\.\d+)$", re.M)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    return cli.train(config(run, "iterations=1"))["last"]


def check_agreement(out):
    """results.json is valid and its numbers agree with the transcripts, game by game."""
    result = json.loads((out / "results.json").read_text())
    games = HEADER.findall((out / "transcripts.md").read_text())
    per_game = result["per_game"]
    assert len(games) == len(per_game) == result["games"]
    for (name, outcome, steps, ret), g in zip(games, per_game):
        assert (name, outcome == "won", int(steps)) == (g["game"], g["won"], g["steps"])
        assert float(ret) == pytest.approx(g["return"], abs=0.005)
    n = len(per_game)
    # every game not won has one failure kind, the same in the transcript and in results.json
    kinds = [o.removeprefix("not won (").removesuffix(")") for _, o, _, _ in games if o != "won"]
    assert result["failures"] == {k: kinds.count(k) for k in result["failures"]}
    assert sum(result["failures"].values()) == n - sum(g["won"] for g in per_game)
    assert result["win_rate"]["mean"] == pytest.approx(sum(g["won"] for g in per_game) / n)
    assert result["steps"]["mean"] == pytest.approx(sum(g["steps"] for g in per_game) / n)
    assert result["return"]["mean"] == pytest.approx(sum(g["return"] for g in per_game) / n)
    for key in ("win_rate", "steps", "return"):
        lo, hi = result[key]["ci95"]
        assert lo <= result[key]["mean"] <= hi
    return result


def test_random_policy(tmp_path, capsys):
    assert main(["--random", "--games", "6", "--batch", "4", "--out", str(tmp_path)]) == 0
    result = check_agreement(tmp_path)
    assert result["policy"] == "random" and result["env"] == "easy" and not result["greedy"]
    assert all(g["steps"] <= 8 for g in result["per_game"])  # easy step limit
    assert "win_rate:" in capsys.readouterr().out
    # the same seed plays the same games the same way
    assert main(["--random", "--games", "6", "--batch", "3", "--out", str(tmp_path / "again")]) == 0
    assert json.loads((tmp_path / "again" / "results.json").read_text())["per_game"] == result["per_game"]


def test_first_game_plays_games_of_seeds_no_run_plays(tmp_path):
    """--first-game N: the held-out games from index N on, seeds outside training's range and past the
    held-out set every run evaluates on (the check that a figure is not a fit to that set)."""
    assert main(["--random", "--games", "3", "--out", str(tmp_path / "own")]) == 0
    assert main(["--random", "--games", "3", "--first-game", "500000", "--out", str(tmp_path / "far")]) == 0
    own, far = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("own", "far"))
    assert [g["game"] for g in own["per_game"]] == ["1000000", "1000001", "1000002"] and own["first_game"] == 0
    assert [g["game"] for g in far["per_game"]] == ["1500000", "1500001", "1500002"] and far["first_game"] == 500000
    with pytest.raises(SystemExit):  # not with game files: they name their own games
        main(["--random", "--games", str(tmp_path), "--first-game", "5"])


def test_tiny_checkpoint(checkpoint, tmp_path):
    assert main(["--checkpoint", checkpoint, "--games", "4", "--out", str(tmp_path)]) == 0
    result = check_agreement(tmp_path)
    assert result["policy"] == f"checkpoint:{checkpoint}" and result["greedy"]
    text = (tmp_path / "transcripts.md").read_text()
    assert text.count("- command: `") == sum(g["steps"] for g in result["per_game"])
    # the alternatives the policy considered, as training's transcripts show them (a step with one
    # admissible command has none)
    listed = re.findall(r"^- next most likely: (.+)$", text, re.M)
    assert listed and all(re.fullmatch(r"[^;]+ \(\d\.\d{3}\)(; [^;]+ \(\d\.\d{3}\))*", a) for a in listed)


def test_a_runs_evaluation_file_is_what_textrl_eval_plays_on_its_checkpoint(checkpoint, tmp_path):
    """Training writes each held-out evaluation as textrl-eval's results.json (bench/families.py
    takes a run's final one instead of playing it again): the same games, played the same way."""
    run = Path(checkpoint).parents[1]
    written = json.loads((run / "evaluation" / "iter_0001.json").read_text())
    assert written["iteration"] == 1 and written["greedy"] and written["policy"] == f"run:{run}"
    assert main(["--checkpoint", checkpoint, "--games", str(written["games"]), "--out", str(tmp_path)]) == 0
    played = json.loads((tmp_path / "results.json").read_text())
    for key in ("env", "max_steps", "games", "win_rate", "steps", "return", "failures", "per_game"):
        assert written[key] == played[key], key
    assert sorted(p.name for p in (run / "evaluation").iterdir()) == ["iter_0000.json", "iter_0001.json"]


@pytest.mark.parametrize("wins, n", [(0, 64), (1, 64), (26, 64), (32, 64), (60, 64), (64, 64), (3, 7)])
def test_wilson_interval_solves_the_score_equation(wins, n):
    """The Wilson bounds are the two roots p of (wins/n - p)^2 = z^2 p (1 - p) / n: solved here as
    a quadratic, independently of the closed form in textrl.results."""
    z2, q = 1.959963984540054**2, wins / n
    a, b, c = 1 + z2 / n, -(2 * q + z2 / n), q * q
    root = math.sqrt(b * b - 4 * a * c)
    assert wilson_interval(wins, n) == pytest.approx([(-b - root) / (2 * a), (-b + root) / (2 * a)], abs=1e-6)


def test_bad_checkpoint_is_named(tmp_path):
    bad = tmp_path / "half.ckpt"
    bad.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(SystemExit, match="checkpoint=.*half.ckpt is not a readable checkpoint"):
        main(["--checkpoint", str(bad)])
    with pytest.raises(SystemExit, match="does not exist"):
        main(["--checkpoint", str(tmp_path / "missing.ckpt")])


def test_play_loads_a_checkpoint(checkpoint, capsys):
    assert play_main(["--checkpoint", checkpoint, "--game", "1", "--top", "2"]) == 0
    out = capsys.readouterr().out
    steps = out.count("\n> ")
    assert steps >= 1 and out.count("%  ") >= 2 * steps
    assert "WON" in out or "out of steps" in out


def test_training_evaluations_log_how_the_games_not_won_failed(checkpoint):
    from pathlib import Path

    from textrl.failures import KINDS
    from tests.conftest import read_metrics

    rows = [r for r in read_metrics(Path(checkpoint).parents[1]) if r.get("eval/win_rate")]
    assert len(rows) == 2  # before and after the iteration
    for r in rows:  # each held-out game either won or failed in exactly one way
        shares = [float(r[f"eval/failures/{kind}"]) for kind in KINDS]
        assert float(r["eval/win_rate"]) + sum(shares) == pytest.approx(1.0)


def test_temperature_plays_sampled_beside_greedy_never_instead(checkpoint, tmp_path):
    """--temperature T: results.json keeps the greedy figures as they are and adds ``sampled``, the
    same games sampled at T (one seed per game from --seed: the same seed plays them the same way)."""
    args = ["--checkpoint", checkpoint, "--games", "16"]
    assert main([*args, "--out", str(tmp_path / "greedy")]) == 0
    assert main([*args, "--temperature", "0.7", "--out", str(tmp_path / "t")]) == 0
    assert main([*args, "--temperature", "0.7", "--out", str(tmp_path / "again")]) == 0
    greedy, sampled, again = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("greedy", "t", "again"))
    assert "sampled" not in greedy and greedy["per_game"] == sampled["per_game"]
    s = sampled["sampled"]
    assert s["temperature"] == 0.7 and s["games"] == 16 and s["per_game"] == again["sampled"]["per_game"]
    assert [g["game"] for g in s["per_game"]] == [g["game"] for g in greedy["per_game"]]
    # the tiny policy's greedy play repeats its likeliest command to the step limit; sampled, it
    # plays about as the random policy, which wins some easy games in 8 steps
    assert [g["steps"] for g in s["per_game"]] != [g["steps"] for g in greedy["per_game"]]
    with pytest.raises(SystemExit):
        main(["--random", "--temperature", "0.7"])


def test_training_evaluation_logs_sampled_play_beside_greedy_with_eval_temperature(tmp_path):
    from tests.conftest import read_metrics

    cli.train(config(tmp_path, "iterations=1", "eval.temperature=0.7"))
    rows = [r for r in read_metrics(tmp_path) if r.get("eval/win_rate")]
    assert len(rows) == 2
    for r in rows:
        assert 0 <= float(r["eval/sampled/win_rate"]) <= 1 and float(r["eval/sampled/episode_len"]) >= 1
    with pytest.raises(Exception, match="eval.temperature"):
        cli.train(config(tmp_path / "bad", "eval.temperature=0"))
