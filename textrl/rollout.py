"""The rollout loop: every environment plays one episode, all decoded together.

Each turn, the prompts of the environments still playing are built, their admissible commands
become tries, and one ``decoder.act`` call picks a command for each; the environments step and the
finished ones leave the batch. ``play_games`` is the one entry point: training rollouts (sampling
at temperature T, one seed per episode), evaluation (greedy), ``textrl-eval`` and the benchmarks
all play through it; ``play_uniform`` is the random-policy baseline.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import random
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from textrl.config import EnvConfig
from textrl.errors import GameFaultError
from textrl.games.env import Game, GameFault, Observation, open_game
from textrl.games.pool import game_name
from textrl.games.prompt import PromptBuilder
from textrl.games.workers import GameWorkers, reset_games, step_games_async
from textrl.policy.decoding import Action, ConstrainedDecoder, Decision, DecodeProfile, forced_action
from textrl.policy.model import PolicyValueModel

log = logging.getLogger(__name__)


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
    lost: bool = False  # the game was lost (only some families can be)
    walkthrough: list[str] = field(default_factory=list)  # the game's winning commands (textrl.failures)
    # value estimate of the state the step limit cut the episode at (training rollouts only)
    bootstrap_value: float | None = None
    # why a game fault (an engine error, no answer in time, a dead worker or engine) cut the episode
    # short: its steps so far are kept for reading, but no update or metric counts it
    aborted: str | None = None

    @property
    def truncated(self) -> bool:
        return bool(self.steps) and self.steps[-1].truncated

    @property
    def length(self) -> int:
        return len(self.steps)

    @property
    def total_return(self) -> float:
        return sum(s.reward for s in self.steps)

    @property
    def repeats(self) -> int:
        """Turns that play a command already played from the same state earlier in the episode
        (``Observation.state``): how a loop shows."""
        seen: set = set()
        count = 0
        for s in self.steps:
            played = (*s.observation.state, s.action.command)
            count += played in seen
            seen.add(played)
        return count


@dataclass
class RolloutStats:
    seconds: float
    decisions: int
    turns: int
    env_s: float = 0.0  # resetting and stepping the games
    decode: DecodeProfile | None = None  # the decoder's share (model calls, drawing); None for the random policy
    wall_s: float | None = None  # play_games: with opening and closing the games

    @property
    def decisions_per_s(self) -> float:
        return self.decisions / max(self.seconds, 1e-9)

    def metrics(self) -> dict[str, float]:
        """``rollout/decisions*`` and where the rollout's time went (``perf/rollout_*``): the games,
        the model calls (prompts / fork levels), the draws; the rest of ``perf/rollout_s`` is Python
        (prompts, tries, bookkeeping)."""
        out = {"rollout/decisions": float(self.decisions), "rollout/decisions_per_s": self.decisions_per_s,
               "perf/rollout_s": self.wall_s if self.wall_s is not None else self.seconds,
               "perf/rollout_env_s": self.env_s}
        if self.decode is not None:
            d = self.decode
            out.update({"perf/rollout_prefill_s": d.prefill_s, "perf/rollout_fork_s": d.fork_s,
                        "perf/rollout_choose_s": d.choose_s, "perf/rollout_tokens": float(d.tokens),
                        "perf/rollout_tokens_per_s": d.tokens / max(d.prefill_s + d.fork_s, 1e-9)})
        return out


def iteration_rng(seed: int, iteration: int) -> random.Random:
    """Game order and minibatch order depend only on (seed, iteration): a resumed run repeats them."""
    return random.Random(seed * 1_000_003 + iteration)


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


@dataclass(frozen=True)
class Sampling:
    """How a training rollout picks commands: each episode samples from its own seed
    (``episode_seeds``) at ``temperature``, each fork mixed with ``explore`` x uniform
    (``textrl.policy.distribution.mix_uniform``). Evaluation plays greedily: no Sampling."""

    temperature: float
    seeds: list[int]
    explore: float = 0.0


def decode_episodes(envs: list[Game], decoders: list, prompts: PromptBuilder, sampling: Sampling | None = None,
                    bootstrap: bool = False) -> tuple[list[Episode], RolloutStats]:
    """Every environment plays one episode with the model behind ``decoders``: sampled with
    ``sampling`` (one seed per environment), greedy without. With ``bootstrap``, an episode cut by
    the step limit gets the value of the state it was cut at (``Episode.bootstrap_value``), for the
    advantages.

    ``decoders`` (each with its own KV cache) split the environments into as many contiguous
    groups, and with games on worker processes one group's games step while the next group decodes
    (``run_episodes``). A row's command depends on its own seed only, so the grouping changes no draw.
    """
    for d in decoders:
        d.reset(record=sampling is not None)  # a training rollout keeps what the update replays
    if sampling is not None and len(sampling.seeds) != len(envs):
        raise ValueError("sampling needs one seed per environment (see episode_seeds)")
    greedy = sampling is None
    temperature = 1.0 if greedy else sampling.temperature
    rngs = None if greedy else [torch.Generator().manual_seed(s) for s in sampling.seeds]
    explore = 0.0 if greedy else sampling.explore

    def state(live: list[int], obs: list[Observation]):
        prompt_ids = [prompts.build(o, envs[i].history) for i, o in zip(live, obs)]
        tries = [prompts.trie(o) for o in obs]
        return prompt_ids, tries

    def act(group: int, live: list[int], obs: list[Observation]) -> list[tuple[list[int], Action]]:
        prompt_ids, tries = state(live, obs)
        actions = decoders[group].act(live, prompt_ids, tries, temperature=temperature, greedy=greedy,
                                      rngs=None if greedy else [rngs[i] for i in live], explore=explore)
        return list(zip(prompt_ids, actions))

    def value(group: int, rows: list[int], obs: list[Observation]) -> list[float]:
        return decoders[group].values(rows, *state(rows, obs))

    episodes, stats = run_episodes(envs, act, value if bootstrap else None, groups=len(decoders))
    profiles = [d.profile for d in decoders if hasattr(d, "profile")]
    stats.decode = DecodeProfile.combined(profiles) if profiles else None
    return episodes, stats


@dataclass
class Player:
    """A policy ready to play games: one decoder (KV cache) per group of games, the autocast the
    policy trains and is evaluated under, and the worker processes games step on (if any).
    Its decoders are made for the games it plays (``env.drop_turns_from_cache``) and, where the
    update replays the frozen blocks' outputs, with their ``capture``: training rollouts record them."""

    policy: PolicyValueModel
    tokenizer: object
    decoders: list[ConstrainedDecoder]
    autocast: Callable[[], AbstractContextManager] = contextlib.nullcontext
    workers: GameWorkers | None = None

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
            self.workers = None


def play_games(player: Player, games: list[Path], env: EnvConfig,
               sampling: Sampling | None = None) -> tuple[list[Episode], RolloutStats]:
    """Open ``games`` with ``env``'s settings, play one episode each (sampled with ``sampling``,
    greedy without), close them. The one function training rollouts, evaluation, ``textrl-eval``
    and the benchmarks play through: the policy in eval mode (gradient checkpointing and dropout
    act in train mode only) under its autocast, with its weights cast to the autocast dtype once
    for the rollout instead of at every call (``PolicyValueModel.weights_cast_once``)."""
    cuts = {d.drop_cut_turns for d in player.decoders if isinstance(d, ConstrainedDecoder)}
    if cuts - {env.drop_turns_from_cache}:  # a decoder is made for its games' setting, never changed by a call
        raise ValueError(f"the player's decoders were made with drop_cut_turns={cuts}; these games have "
                         f"env.drop_turns_from_cache={env.drop_turns_from_cache}")
    start = time.perf_counter()
    prompts = PromptBuilder.for_env(player.tokenizer, env)
    envs = player.workers.open(games, env) if player.workers else [open_game(g, env) for g in games]
    was_training = player.policy.training
    try:
        player.policy.eval()
        with torch.no_grad(), player.autocast(), player.policy.weights_cast_once():
            episodes, stats = decode_episodes(envs, player.decoders, prompts, sampling, bootstrap=sampling is not None)
    finally:
        player.policy.train(was_training)
        for e in envs:
            e.close()
        for decoder in player.decoders:
            decoder.reset()  # free the KV cache between rollouts
    stats.wall_s = time.perf_counter() - start
    return episodes, stats


def replay_commands(game: Game, prompts: PromptBuilder, commands: list[str] | None = None) -> Episode:
    """``commands`` (None: the game's walkthrough) played from ``game``'s reset as an episode of
    forced actions (``forced_action``): the turns a rollout that chose them would record (the same
    prompts, tries and decisions; no log-probs or values). It stops before the first command that is
    not admissible, or when the game ends; ``won`` says whether the commands won. The walkthrough
    warm start trains on these. The caller opens and closes ``game``; a game fault
    is the caller's (``GameFault``)."""
    episode = Episode(game=str(game.game_file))
    obs = game.reset()
    for command in game.walkthrough if commands is None else commands:
        if command not in obs.admissible_commands:
            break
        prompt_ids = prompts.build(obs, game.history)  # before the step, as in a rollout
        trie = prompts.trie(obs)
        result = game.step(command)
        episode.steps.append(Step(obs, prompt_ids, forced_action(trie, command), result.reward,
                                  result.terminated, result.truncated, result.observation.feedback))
        obs = result.observation
        episode.won, episode.lost = obs.won, obs.lost
        if result.done:
            break
    return episode


def play_uniform(envs: list[Game], seed: int = 0) -> tuple[list[Episode], RolloutStats]:
    """The random-policy baseline: a uniformly random admissible command every turn.

    Each game draws from its own generator, seeded by ``seed`` and the game's seed, so a game is
    played the same way whatever batch it is in. The action is one decision over the commands (not
    tokens), with log-prob -log(number of commands), so transcripts and metrics treat it like a model's.
    """
    rngs = [random.Random(f"{seed}/{game_name(env.game_file)}") for env in envs]

    def act(group: int, live: list[int], obs: list[Observation]) -> list[tuple[list[int], Action]]:
        chosen = []
        for i, o in zip(live, obs):
            n = len(o.admissible_commands)
            k = rngs[i].randrange(n)
            decision = Decision(index=0, allowed=list(range(n)), token=k, logprob=-math.log(n), value=0.0)
            chosen.append(([], Action(o.admissible_commands[k], [], [decision], temperature=1.0)))
        return chosen

    return run_episodes(envs, act)


def run_episodes(envs: list[Game], act, value=None, groups: int = 1) -> tuple[list[Episode], RolloutStats]:
    """The loop itself: reset all, then each turn ``act(group, live, observations)`` gives (prompt
    ids, action) for a group's environments still playing; they step, and finished ones leave.
    At the end ``value(group, rows, observations)``, if given, values the states truncated episodes
    stop in.

    Environments are split into ``groups`` contiguous blocks. Each round, every group in turn
    collects the outcome of its last step, then decodes and sends its next commands. Stepping is
    asynchronous when the games live on worker processes (``step_games_async``), so one group's
    games step while the next group decodes; in process it is done by the time the call returns.
    ``env_s`` is the time this loop spends on games: stepping them, or waiting for their outcome.

    A game that faults (``GameFault``: its engine raised, answered too late, or died) leaves like a
    finished one, its episode marked ``aborted`` and logged with the game file and the engine's
    traceback; so does a game that offers no command at its start. A game that offers none after a
    step ends its episode there (``terminated``, not won: ``Game.step``), with a log line. Each
    episode draws from its own generator, so the other episodes play as they would without them.
    """
    start = time.perf_counter()
    episodes = [Episode(game=str(env.game_file)) for env in envs]
    openings = reset_games(envs)
    env_s = time.perf_counter() - start
    for i, opening in enumerate(openings):
        if not isinstance(opening, GameFault) and not opening.admissible_commands:
            openings[i] = GameFault(str(envs[i].game_file), "it offers no admissible command at its start")
        if isinstance(openings[i], GameFault):
            _abort(episodes[i], openings[i])
        else:
            episodes[i].walkthrough = list(envs[i].walkthrough)
    # contiguous blocks: game workers hold games round-robin, so each block spreads over all of them
    bounds = [round(g * len(envs) / groups) for g in range(groups + 1)]
    blocks = [list(range(bounds[g], bounds[g + 1])) for g in range(groups)]
    live = [[i for i in b if episodes[i].aborted is None] for b in blocks]
    pending: list = [None] * groups  # per group: (rows, observations, chosen, steps in flight)
    decisions = turns = 0
    while any(live) or any(pending):
        for g in range(groups):
            if pending[g] is not None:
                rows, obs, chosen, steps = pending[g]
                pending[g] = None
                waited = time.perf_counter()
                results = steps.result()
                env_s += time.perf_counter() - waited
                still = []
                for i, o, (p, a), result in zip(rows, obs, chosen, results):
                    if isinstance(result, GameFault):
                        _abort(episodes[i], result)
                        continue
                    episodes[i].steps.append(Step(o, p, a, result.reward, result.terminated, result.truncated,
                                                  result.observation.feedback))
                    episodes[i].won, episodes[i].lost = result.observation.won, result.observation.lost
                    decisions += len(a.decisions)
                    turns += 1
                    if not result.done:
                        still.append(i)
                    elif not (result.observation.admissible_commands or result.observation.won
                              or result.observation.lost):
                        log.warning("%s offers no admissible command after %r (step %d): its episode ends there, "
                                    "not won", episodes[i].game, a.command, episodes[i].length)
                live[g] = still
            if live[g]:
                obs = [envs[i].observation for i in live[g]]
                chosen = act(g, live[g], obs)
                sent = time.perf_counter()
                pending[g] = (live[g], obs, chosen,
                              step_games_async([envs[i] for i in live[g]], [a.command for _, a in chosen]))
                env_s += time.perf_counter() - sent
    if value is not None:
        for g in range(groups):
            cut = [i for i in blocks[g] if episodes[i].truncated and episodes[i].aborted is None]
            if cut:
                for i, v in zip(cut, value(g, cut, [envs[i].observation for i in cut])):
                    episodes[i].bootstrap_value = v
    return episodes, RolloutStats(time.perf_counter() - start, decisions, turns, env_s)


def _abort(episode: Episode, fault: GameFault) -> None:
    episode.aborted = fault.reason
    log.warning("episode of %s aborted: %s%s", fault.game_file, fault.reason,
                f"\n{fault.detail.rstrip()}" if fault.detail else "")


def check_aborted(aborted: float, total: float, max_aborted: float, what: str) -> None:
    """Stop the run when more than ``max_aborted`` (``env.max_aborted``) of ``total`` episodes were
    aborted by game faults: games that fail that often are no training signal."""
    if total and aborted / total > max_aborted:
        raise GameFaultError(f"{aborted:g} of {total:g} {what} episodes were aborted by game faults, more than "
                             f"env.max_aborted={max_aborted:g} of them; the log names each game and its error")
