"""The rollout loop: every environment plays one episode, all decoded together.

Each turn, the prompts of the environments still playing are built, their admissible commands
become tries, and one ``decoder.act`` call picks a command for each; the environments step and the
finished ones leave the batch. Used for training rollouts (sampling at temperature T, one seed per
episode) and for evaluation (greedy); ``play_uniform`` is the random-policy baseline.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from textrl.games.env import Game, Observation
from textrl.games.pool import game_name
from textrl.games.workers import reset_games, step_games
from textrl.games.prompt import PromptBuilder
from textrl.policy.decoding import Action, Decision, DecodeProfile
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
    # value estimate of the state the step limit cut the episode at (training rollouts only)
    bootstrap_value: float | None = None

    @property
    def truncated(self) -> bool:
        return bool(self.steps) and self.steps[-1].truncated

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
    env_s: float = 0.0  # resetting and stepping the games
    decode: DecodeProfile | None = None  # the decoder's share (model calls, drawing); None for the random policy

    @property
    def decisions_per_s(self) -> float:
        return self.decisions / max(self.seconds, 1e-9)


def episode_seeds(seed: int, iteration: int, games: list) -> list[int]:
    """One sampling seed per episode, from the run's seed, the iteration and the game (and how many
    times the game already occurs in the list): an episode samples the same commands whatever
    batch, rank or order it is played in, and a resumed run replays it exactly."""
    seen: dict[str, int] = {}
    seeds = []
    for game in games:
        name = game_name(game)
        k = seen[name] = seen.get(name, -1) + 1
        digest = hashlib.sha256(f"{seed}/{iteration}/{name}/{k}".encode()).digest()
        seeds.append(int.from_bytes(digest[:8], "little") >> 1)
    return seeds


def play(envs: list[Game], decoder, prompts: PromptBuilder, temperature: float = 1.0, greedy: bool = False,
         seeds: list[int] | None = None, bootstrap: bool = False, explore: float = 0.0) -> tuple[list[Episode], RolloutStats]:
    """Every environment plays one episode with the model behind ``decoder``.

    Sampling (``greedy=False``) needs one seed per environment (``episode_seeds``) and mixes each
    fork with ``explore`` x uniform (``textrl.policy.decoding.mix_uniform``). With
    ``bootstrap``, an episode cut by the step limit gets the value of the state it was cut at
    (``Episode.bootstrap_value``), for the advantages.
    """
    decoder.reset()
    if not greedy and (seeds is None or len(seeds) != len(envs)):
        raise ValueError("sampling needs one seed per environment (see episode_seeds), or greedy=True")
    rngs = None if greedy else [torch.Generator().manual_seed(s) for s in seeds]

    def state(live: list[int], obs: list[Observation]):
        prompt_ids = [prompts.build(o, envs[i].history) for i, o in zip(live, obs)]
        tries = [CommandTrie(o.admissible_commands, prompts.encode_command, prompts.end_id) for o in obs]
        return prompt_ids, tries

    def act(live: list[int], obs: list[Observation]) -> list[tuple[list[int], Action]]:
        prompt_ids, tries = state(live, obs)
        actions = decoder.act(live, prompt_ids, tries, temperature=temperature, greedy=greedy,
                              rngs=None if greedy else [rngs[i] for i in live], explore=explore)
        return list(zip(prompt_ids, actions))

    def value(rows: list[int], obs: list[Observation]) -> list[float]:
        return decoder.values(rows, *state(rows, obs))

    episodes, stats = run_episodes(envs, act, value if bootstrap else None)
    stats.decode = getattr(decoder, "profile", None)
    return episodes, stats


def play_uniform(envs: list[Game], seed: int = 0) -> tuple[list[Episode], RolloutStats]:
    """The random-policy baseline: a uniformly random admissible command every turn.

    Each game draws from its own generator, seeded by ``seed`` and the game's seed, so a game is
    played the same way whatever batch it is in. The action is one decision over the commands (not
    tokens), with log-prob -log(number of commands), so transcripts and metrics treat it like a model's.
    """
    rngs = [random.Random(f"{seed}/{game_name(env.game_file)}") for env in envs]

    def act(live: list[int], obs: list[Observation]) -> list[tuple[list[int], Action]]:
        chosen = []
        for i, o in zip(live, obs):
            n = len(o.admissible_commands)
            k = rngs[i].randrange(n)
            decision = Decision(index=0, allowed=list(range(n)), token=k, logprob=-math.log(n), value=0.0)
            chosen.append(([], Action(o.admissible_commands[k], [], [decision], temperature=1.0)))
        return chosen

    return run_episodes(envs, act)


def run_episodes(envs: list[Game], act, value=None) -> tuple[list[Episode], RolloutStats]:
    """The loop itself: reset all, then each turn ``act(live, observations)`` gives (prompt ids,
    action) for the environments still playing; they step, and finished ones leave the batch.
    At the end ``value(rows, observations)``, if given, values the states truncated episodes stop in."""
    start = time.perf_counter()
    episodes = [Episode(game=str(env.game_file)) for env in envs]
    reset_games(envs)
    env_s = time.perf_counter() - start
    live = list(range(len(envs)))
    decisions = turns = 0
    while live:
        obs = [envs[i].observation for i in live]
        still = []
        chosen = act(live, obs)
        stepped = time.perf_counter()  # every game steps (on workers: side by side) before any is read
        results = step_games([envs[i] for i in live], [a.command for _, a in chosen])
        env_s += time.perf_counter() - stepped
        for i, o, (p, a), result in zip(live, obs, chosen, results):
            episodes[i].steps.append(Step(o, p, a, result.reward, result.terminated, result.truncated,
                                          result.observation.feedback))
            episodes[i].won = result.observation.won
            decisions += len(a.decisions)
            turns += 1
            if not result.done:
                still.append(i)
        live = still
    cut = [i for i, e in enumerate(episodes) if e.truncated]
    if value is not None and cut:
        for i, v in zip(cut, value(cut, [envs[i].observation for i in cut])):
            episodes[i].bootstrap_value = v
    return episodes, RolloutStats(time.perf_counter() - start, decisions, turns, env_s)


def episode_metrics(episodes: list[Episode], prefix: str) -> dict[str, float]:
    n = max(len(episodes), 1)
    return {
        f"{prefix}/win_rate": sum(e.won for e in episodes) / n,
        f"{prefix}/episode_len": sum(e.length for e in episodes) / n,
        f"{prefix}/return": sum(e.total_return for e in episodes) / n,
    }
