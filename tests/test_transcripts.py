"""Evaluation transcripts where the curves are: rows with the policy's alternatives, a W&B Table
(offline run), TensorBoard text; the Markdown files stay."""

import json
import math
import os
import re

import pytest
import torch

from tests.conftest import config
import textrl.cli.train as cli
from textrl.games.env import TextGame
from textrl.policy.decoding import ConstrainedDecoder, score_commands
from textrl.policy.trie import CommandTrie
from textrl.rollout import decode_episodes
from textrl.transcripts import COLUMNS, transcript_rows


def test_rows_hold_each_step_with_the_policys_alternatives(tiny, prompts, easy_games):
    policy, tokenizer = tiny
    envs = [TextGame(g, 3) for g in easy_games[:2]]
    with torch.no_grad():
        episodes, _ = decode_episodes(envs, [ConstrainedDecoder(policy)], prompts)
    rows = transcript_rows(episodes, policy, prompts, top=2)
    steps = [s for e in episodes for s in e.steps]
    assert len(rows) == len(steps) > 2
    for row, s in zip(rows, steps):
        row = dict(zip(COLUMNS, row))
        assert row["command"] == s.action.command and row["objective"] == s.observation.objective
        probs = score_commands(policy, s.prompt_ids, CommandTrie(s.observation.admissible_commands,
                                                                 prompts.encode_command, prompts.end_id))
        assert math.isclose(row["p"], probs[s.action.command], abs_tol=1e-3)  # the decoder's and a fresh scoring agree
        best = sorted(((p, c) for c, p in probs.items() if c != s.action.command), reverse=True)[:2]
        assert row["alternatives"] == "; ".join(f"{c} ({p:.3f})" for p, c in best)


def test_wandb_run_logs_the_transcripts_as_a_table(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    wandb.finish()  # a run another test left open would be reused by the logger (and log elsewhere)
    cli.train(config(tmp_path, "logger=wandb", "iterations=1", "eval.transcripts=2"))
    wandb.finish()
    os.environ.pop("WANDB_MODE", None)
    tables = sorted(tmp_path.glob("wandb/offline-run-*/files/media/table/eval/transcripts_*.table.json"),
                    key=lambda p: int(p.name.split("_")[1]))  # transcripts_<W&B step>_<hash>
    assert len(tables) == 2  # two evaluations: before training and after iteration 1
    table = json.loads(tables[-1].read_text())
    assert table["columns"] == COLUMNS
    markdown = (tmp_path / "transcripts" / "iter_0001.md").read_text()
    assert len(table["data"]) == markdown.count("**Step ") > 0
    for row in table["data"]:
        row = dict(zip(COLUMNS, row))
        assert f"`{row['command']}` (p = {row['p']:.3f})" in markdown
        assert re.fullmatch(r"[^;()]+ \([01]\.\d{3}\)(; [^;()]+ \([01]\.\d{3}\)){0,2}", row["alternatives"])
        assert f"next most likely: {row['alternatives']}" in markdown


def test_tensorboard_run_logs_the_transcripts_as_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cli.train(config(tmp_path, "logger=tensorboard", "iterations=1", "eval.transcripts=2"))
    events = EventAccumulator(str(tmp_path / "logs"), size_guidance={"tensors": 0})
    events.Reload()
    before, text = events.Tensors("eval/transcripts/text_summary")  # before training, after iteration 1
    assert (before.step, text.step) == (0, 1)
    logged = text.tensor_proto.string_val[0].decode()
    assert logged == (tmp_path / "transcripts" / "iter_0001.md").read_text() and "next most likely:" in logged


def test_probe_probabilities_are_the_policys_own_for_each_walkthrough_first_command(tmp_path):
    from tests.conftest import read_metrics
    from textrl.config import load_env_config
    from textrl.games.env import open_game
    from textrl.games.pool import game_name
    from textrl.games.prompt import PromptBuilder

    result = cli.train(config(tmp_path, "iterations=1", "eval.probes=3"))
    module = result["module"]
    probes = result["trainer"].datamodule.eval_games[:3]
    last = [r for r in read_metrics(tmp_path) if r.get("probe/mean")][-1]  # after iteration 1: the final weights
    prompts = PromptBuilder.for_env(module.tokenizer, load_env_config("easy"))
    direct = []
    for path in probes:
        game = open_game(path, module.cfg.env)
        obs = game.reset()
        trie = CommandTrie(obs.admissible_commands, prompts.encode_command, prompts.end_id)
        with torch.no_grad():
            p = score_commands(module.policy.eval(), prompts.build(obs, []), trie)[game.walkthrough[0]]
        assert float(last[f"probe/{game_name(path)}"]) == pytest.approx(p, abs=1e-5)
        direct.append(p)
    assert float(last["probe/mean"]) == pytest.approx(sum(direct) / 3, abs=1e-5)
    assert len([r for r in read_metrics(tmp_path) if r.get("probe/mean")]) == 2  # every evaluation: before and after
