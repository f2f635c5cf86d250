"""Readable Markdown transcripts of played episodes: what the agent saw, chose (with its
probability) and got, step by step. Written by evaluation during training and by textrl-eval."""

from __future__ import annotations

import math
from pathlib import Path

from textrl.games.pool import game_name
from textrl.games.prompt import observation_text
from textrl.rollout import Episode


def write_transcripts(episodes: list[Episode], path: Path, title: str) -> None:
    lines = [f"# {title}\n"]
    for e in episodes:
        outcome = "won" if e.won else "lost"
        lines.append(f"## {game_name(e.game)}: {outcome} in {e.length} steps, return {e.total_return:+.2f}\n")
        lines.append(f"**Goal:** {e.steps[0].observation.objective}\n" if e.steps else "")
        for i, s in enumerate(e.steps, 1):
            quoted = "\n".join("> " + line for line in observation_text(s.observation).splitlines())
            lines.append(f"**Step {i}**\n\n{quoted}\n")
            lines.append(f"- command: `{s.action.command}` (p = {math.exp(s.action.logprob):.3f})")
            lines.append(f"- reward: {s.reward:+.2f}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
