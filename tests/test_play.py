import subprocess
import sys

from textrl.cli.play import main


def test_human_play_refuses_bad_commands_and_accepts_numbers_and_text(monkeypatch, capsys):
    lines = iter(["dance wildly", "0", "look", "look", "quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["--difficulty", "easy", "--game", "2"]) == 0
    out = capsys.readouterr().out
    assert "'dance wildly' is not admissible here" in out
    # "0" and "look" twice were played: a person is offered every command (env.block_repeats would
    # refuse the second "look" from the same state)
    assert out.count("reward -0.10") + out.count("reward +") == 3
    assert out.count("not admissible here") == 1
    assert "GOAL:" in out and out.rstrip().endswith("bye")


def test_watching_the_tiny_model_play_shows_top_commands(easy_games):
    out = subprocess.run([sys.executable, "-m", "textrl.cli.play", "--model", "tiny", "--top", "3",
                          "--game-file", str(easy_games[5])], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    steps = out.stdout.count("\n> ")
    assert steps >= 1 and ("WON" in out.stdout or "out of steps" in out.stdout)
    assert out.stdout.count("%  ") >= 3 * steps  # the 3 most likely commands at every step
