"""textrl-play with a trained checkpoint: it plays as the policy was evaluated (the checkpoint's
autocast, the same greedy choices as textrl-eval), and writes only where the user's cache is; so
does textrl-attention, the other command that runs a checkpoint's policy outside textrl-eval."""

import re
from contextlib import contextmanager

import pytest
import torch

import textrl.cli.train as cli
from tests.conftest import config
from textrl.cli.attention import main as attention_main
from textrl.cli.evaluate import main as eval_main
from textrl.cli.play import main as play_main
from textrl.policy.checkpoint import load

COMMAND = re.compile(r"^- command: `([^`]*)`", re.M)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    return cli.train(config(run, "iterations=1", "memory=bf16", "eval.before_training=false",
                            "eval.transcripts=0"))["last"]


@contextmanager
def autocast_of_every_linear():
    """The autocast dtype (None: no autocast) each linear layer's forward ran under, in order."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where textrl-play runs the model
    seen = []

    def record(module, args):
        if isinstance(module, torch.nn.Linear):
            seen.append(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        yield seen
    finally:
        handle.remove()


def test_play_chooses_what_textrl_eval_chooses_under_the_checkpoints_autocast(bf16_checkpoint, easy_games,
                                                                              tmp_path, capsys):
    for k, game in enumerate(easy_games[:2]):
        out = tmp_path / f"eval{k}"
        assert eval_main(["--checkpoint", bf16_checkpoint, "--games", str(game), "--batch", "1", "--out", str(out)]) == 0
        evaluated = COMMAND.findall((out / "transcripts.md").read_text())
        capsys.readouterr()
        with autocast_of_every_linear() as seen:
            assert play_main(["--checkpoint", bf16_checkpoint, "--game-file", str(game), "--top", "2"]) == 0
        played = [line[2:] for line in capsys.readouterr().out.splitlines() if line.startswith("> ")]
        assert played and played == evaluated
        assert seen and set(seen) == {torch.bfloat16}  # every forward under memory=bf16's autocast


@pytest.mark.parametrize("command", ["play", "attention"])
def test_never_writes_into_the_cache_dir_a_checkpoint_names(command, bf16_checkpoint, easy_games, tmp_path):
    """A shared checkpoint names its trainer's cache directory; textrl-play and textrl-attention
    convert models and generate games in the user's cache (--cache-dir, $TEXTRL_CACHE,
    ~/.cache/textrl) instead."""
    theirs = tmp_path / "their_cache"
    state = load(bf16_checkpoint)
    state["textrl"]["config"]["cache_dir"] = str(theirs)
    foreign = tmp_path / "foreign.ckpt"
    torch.save(state, foreign)
    if command == "play":
        assert play_main(["--checkpoint", str(foreign), "--game-file", str(easy_games[0]), "--top", "1"]) == 0
        assert play_main(["--checkpoint", str(foreign), "--game", "1", "--top", "1"]) == 0  # from the game pool
    else:
        with autocast_of_every_linear() as seen:
            assert attention_main(["--checkpoint", str(foreign), "--game", "1", "--out", str(tmp_path / "att")]) == 0
        assert seen and set(seen) == {torch.bfloat16}  # and it looks under the checkpoint's autocast too
    assert not theirs.exists()
