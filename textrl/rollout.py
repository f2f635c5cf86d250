"""The rollout loop: every environment plays one episode, all decoded together.

Each turn, the prompts of the environments still playing are built, their admissible commands
become tries, and one ``decoder.act`` call picks a command for each; the environments step and the
finished ones leave the batch. Used for training rollouts (sampling at temperature T) and for
evaluation (greedy).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from textrl.games.env import Observation, TextGame
from textrl.games.prompt import PromptBuilder
from textrl.policy.decoding import Action
from textrl.policy.trie import CommandTrie


@dataclass
class Step:
    observation: Observation  # what the agent saw
    prompt_ids: list[int]
    action: Action
    reward: float
    terminated: bool
    truncated: bool
    feedback: str  # the game's answer to the command


@dataclass
class Episode:
    game: str
    steps: list[Step] = field(default_factory=list)
    won: bool = False

    @property
    def length(self) -> int:
        return len(self.steps)

    @property
    def total_return(self) -> float:
        return sum(s.reward for s in self.steps)


@dataclass
class RolloutStats:
    seconds: float
    decisions: int
    turns: int

    @property
    def decisions_per_s(self) -> float:
        return self.decisions / max(self.seconds, 1e-9)


def play(envs: list[TextGame], decoder, prompts: PromptBuilder, temperature: float = 1.0, greedy: bool = False,
         generator: torch.Generator | None = None) -> tuple[list[Episode], RolloutStats]:
    start = time.perf_counter()
    decoder.reset()
    episodes = [Episode(game=str(env.game_file)) for env in envs]
    for env in envs:
        env.reset()
    live = list(range(len(envs)))
    decisions = turns = 0
    while live:
        obs = [envs[i].observation for i in live]
        prompt_ids = [prompts.build(o, envs[i].history) for i, o in zip(live, obs)]
        tries = [CommandTrie(o.admissible_commands, prompts.encode_command, prompts.end_id) for o in obs]
        actions = decoder.act(live, prompt_ids, tries, temperature=temperature, greedy=greedy, generator=generator)
        still = []
        for i, o, p, a in zip(live, obs, prompt_ids, actions):
            result = envs[i].step(a.command)
            episodes[i].steps.append(Step(o, p, a, result.reward, result.terminated, result.truncated,
                                          result.observation.feedback))
            episodes[i].won = result.observation.won
            decisions += len(a.decisions)
            turns += 1
            if not result.done:
                still.append(i)
        live = still
    return episodes, RolloutStats(time.perf_counter() - start, decisions, turns)
