"""Behaviour cloning on walkthroughs: the optional warm start before PPO (``warm_start.steps``).

Every generated TextWorld game ships a walkthrough. Each of ``warm_start.games`` training games
(the pool's train split: evaluation games are never read) is replayed through ``open_game`` with its
walkthrough; one that asks for a command that is not admissible, or that does not win within the
step limit, is skipped and counted. A replayed step is exactly the turn a rollout would record: the
same prompt (``PromptBuilder``, same history), the same trie of the admissible commands, the same
decisions at its forks (``forced_action``), merged into sequences (``training_sequences``). One
difference from a rollout: a forced action has no stream place, so where the history is cut the
warm start's sequence starts again from the cut prompt instead of dropping the cut turns from the
cache as the decoder does (medium and hard walkthroughs that run past ``env.history_len`` turns).

``warm_start.source=random_play`` clones wins the agent found by random play instead of the
walkthroughs (RL alone, nothing a game ships; ``textrl.training.random_play``), the same way.

The loss is the cross-entropy of the walkthrough's token at each decision over the fork's allowed
tokens (the masked distribution the PPO update computes, at T = 1), the mean over the decisions of
an optimizer step. Only the LM learns; the value head starts PPO untouched (walkthroughs always win,
so their returns would teach it nothing about failing).

Device and precision come from Lightning Fabric with the run's ``memory.precision``: the same
autocast (and gradient scaler under ``16-mixed``) as the PPO update, on the device the Trainer will
use. It runs before the Trainer exists, so the evaluation at iteration 0 and the KL anchor's
reference both see the warm-started policy.
"""

from __future__ import annotations

import logging
import math
import random
import time
from pathlib import Path

import torch

from textrl.config import TrainConfig
from textrl.errors import ConfigError, NonFiniteError
from textrl.games.env import open_game
from textrl.games.pool import GamePool, GameSpec
from textrl.games.prompt import PromptBuilder
from textrl.policy.device import trainer_device
from textrl.policy.distribution import fork_logprobs
from textrl.policy.memory import make_optimizer
from textrl.policy.model import PolicyValueModel
from textrl.policy.speed import FrozenPrefix
from textrl.ppo.skipped_steps import SkippedSteps
from textrl.ppo.sequences import PrefixOutputs, TrainingSequence, decision_forward, training_sequences
from textrl.rollout import Episode, replay_commands
from textrl.training.random_play import random_play_episodes

log = logging.getLogger(__name__)

# the walkthrough commands' probability, before and after, is measured on the first this many
# sequences: on all of them each pass cost a third of the cloning (6.5 minutes of hard's 32, twice)
PROBE_SEQUENCES = 32


def walkthrough_episodes(games: list[Path], prompts: PromptBuilder, cfg: TrainConfig) -> tuple[list[Episode], list[str]]:
    """Each game's walkthrough replayed as an episode of forced actions (``replay_commands``);
    (winning episodes, the games whose walkthrough was not admissible or did not win)."""
    kept, skipped = [], []
    for game in games:
        env = open_game(game, cfg.env)
        try:
            episode = replay_commands(env, prompts)
        finally:
            env.close()
        if episode.won:
            kept.append(episode)
        else:
            skipped.append(str(game))
    return kept, skipped


def _decision_logprobs(policy: PolicyValueModel, batch: list[TrainingSequence], pad_id: int,
                       prefix: PrefixOutputs | None = None) -> torch.Tensor:
    d = decision_forward(policy, batch, pad_id, prefix)
    return fork_logprobs(d.logits, d.valid).gather(1, d.chosen[:, None]).squeeze(1)


@torch.no_grad()
def command_probability(policy: PolicyValueModel, sequences: list[TrainingSequence], pad_id: int, fabric,
                        turns: list[int], batch: int) -> float:
    """Mean over the walkthrough's turns of the probability the policy gives the whole command
    (the product over its decisions). ``turns[k]``: the turn of the k-th decision of ``sequences``
    in order (a list of a longer run's turns is cut to the decisions of ``sequences``)."""
    logps = []
    with fabric.autocast(), policy.weights_cast_once():
        for i in range(0, len(sequences), batch):
            logps += _decision_logprobs(policy, sequences[i: i + batch], pad_id).float().cpu().tolist()
    per_turn: dict[int, float] = {}
    for turn, lp in zip(turns, logps):
        per_turn[turn] = per_turn.get(turn, 0.0) + lp
    return sum(math.exp(v) for v in per_turn.values()) / max(len(per_turn), 1)


def make_fabric(cfg: TrainConfig):
    """Lightning Fabric on the device the Trainer will train on, with the run's precision."""
    from lightning.fabric import Fabric

    # the device the Trainer will give this process (its GPU of trainer.devices: a sweep job's slot, a
    # DDP rank's own; LOCAL_RANK is a rank, not a GPU index). Under DDP every rank warm-starts
    # identically on its own GPU; DDP then broadcasts rank 0's weights
    device = trainer_device(cfg.trainer)
    if device.type == "cuda":
        return Fabric(accelerator="cuda", devices=[device.index], precision=cfg.memory.precision)
    return Fabric(accelerator="cpu", devices=1, precision=cfg.memory.precision)


def _clone_walkthroughs(policy: PolicyValueModel, sequences: list[TrainingSequence], fabric, optimizer,
                        cfg: TrainConfig, pad_id: int) -> tuple[list[float], int]:
    """``warm_start.steps`` optimizer steps of behaviour cloning, each on ``warm_start.batch``
    sequences of shuffled passes; returns each step's loss and how many steps were skipped for a
    non-finite gradient (as in the PPO update: never applied; ``ppo.max_skipped_steps`` in a row,
    or a non-finite weight at the end, raise ``NonFiniteError``)."""
    w, mb = cfg.warm_start, cfg.ppo.minibatch_size
    rng = random.Random(cfg.seed)
    order: list[int] = []
    was_training = policy.training
    policy.train()
    losses, skipped = [], 0
    skips = SkippedSteps(cfg.ppo.max_skipped_steps, "warm start", "lower warm_start.lr")
    scaled = getattr(fabric.strategy.precision, "scaler", None) is not None  # 16-mixed: the scaler skips them
    # the frozen blocks' output over each sequence, recorded at its first forward and replayed by
    # every later pass (as the PPO update replays the rollout's, ``ppo.cache_frozen``): the same
    # tensor the blocks would compute again, so the same steps, with the frozen blocks run once
    frozen = FrozenPrefix.of(policy.lm) if cfg.ppo.cache_frozen else None
    prefix = PrefixOutputs(frozen, [None] * len(sequences)) if frozen is not None else None
    # a progress line about 8 times in all (every step below 16 steps): on a CPU, 256 medium
    # walkthroughs take a quarter of an hour
    report_every, started = max(1, w.steps // 8), time.perf_counter()
    for step in range(1, w.steps + 1):
        batch = []
        while len(batch) < min(w.batch, len(sequences)):
            if not order:  # shuffled passes over the walkthrough sequences
                order = list(range(len(sequences)))
                rng.shuffle(order)
            batch.append(sequences[order.pop()])
        n = sum(len(s.tokens) for s in batch)
        total = 0.0
        # the step's forwards share one cast of each weight (backward under the autocast, as in the PPO update)
        with fabric.autocast(), policy.weights_cast_once():
            for i in range(0, len(batch), mb):
                nll = -_decision_logprobs(policy, batch[i: i + mb], pad_id, prefix).float().sum() / n
                fabric.backward(nll)
                total += float(nll.detach())  # for the log only
        norm = fabric.clip_gradients(policy, optimizer, max_norm=cfg.ppo.max_grad_norm, error_if_nonfinite=False)
        step_it, taken = skips.decide(total, [float(norm)], scaled)
        if step_it:  # under fp16 a gradient overflow is the scaler's to skip
            optimizer.step()
        skipped += not taken
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        if step % report_every == 0 or step == w.steps:
            log.info("warm start: step %d of %d, cross-entropy %.3f, %.0f s", step, w.steps, total,
                     time.perf_counter() - started)
    policy.train(was_training)
    if not all(bool(q.isfinite().all()) for q in policy.parameters() if q.requires_grad):
        raise NonFiniteError("warm start: a trainable weight is not finite; lower warm_start.lr")
    return losses, skipped


def warm_start(policy: PolicyValueModel, tokenizer, cfg: TrainConfig) -> dict[str, float]:
    """Train ``policy``'s LM on the walkthroughs of ``warm_start.games`` training games for
    ``warm_start.steps`` optimizer steps; returns the stage's figures (``warm_start/...``)."""
    w, e = cfg.warm_start, cfg.env
    start = time.perf_counter()
    fabric = make_fabric(cfg)
    policy.to(fabric.device)
    prompts = PromptBuilder.for_env(tokenizer, e)
    games = GamePool(GameSpec.from_env(e), cache_dir=cfg.cache_dir, workers=e.workers).games("train", w.games)
    if w.source == "random_play":
        episodes, skipped, found = random_play_episodes(games, prompts, cfg)
    else:
        episodes, skipped = walkthrough_episodes(games, prompts, cfg)
        found = {"warm_start/walkthroughs": float(len(episodes))}
        if skipped:
            log.warning("warm start: %d of %d walkthroughs skipped (a command not admissible, or no win "
                        "within the step limit): %s", len(skipped), len(games), ", ".join(skipped[:5]))
    sequences = training_sequences(episodes).sequences
    # the turn of each decision, in the order the sequences hold them
    steps = [step for episode in episodes for step in episode.steps]
    turns = [t for t, step in enumerate(steps) for _ in step.action.decisions]
    if not sequences:
        if w.source == "random_play":
            raise ConfigError(f"warm_start.source=random_play: none of the {len(games)} training games of env={e.name} "
                              f"was won in warm_start.tries={w.tries} episodes of random play (loops erased); "
                              "raise warm_start.tries or warm_start.games")
        raise ConfigError(f"warm_start.steps={w.steps}: none of the {len(games)} walkthroughs of env="
                          f"{e.name} wins within its step limit; raise env.max_steps or set warm_start.steps=0")
    pad_id = tokenizer.pad_token_id
    mb = cfg.ppo.minibatch_size
    params = [p for p in policy.lm.parameters() if p.requires_grad]
    optimizer = fabric.setup_optimizers(make_optimizer(params, [], cfg.memory, w.lr, w.lr, cfg.ppo.weight_decay))
    probe = sequences[:PROBE_SEQUENCES]
    prob_start = command_probability(policy, probe, pad_id, fabric, turns, mb)

    losses, skipped_steps = _clone_walkthroughs(policy, sequences, fabric, optimizer, cfg, pad_id)
    prob_end = command_probability(policy, probe, pad_id, fabric, turns, mb)
    figures = {
        **found, "warm_start/skipped": float(len(skipped)),
        "warm_start/decisions": float(len(turns)), "warm_start/loss_first": losses[0] if losses else float("nan"),
        "warm_start/loss_last": losses[-1] if losses else float("nan"),
        "warm_start/command_prob_start": prob_start, "warm_start/command_prob_end": prob_end,
        "warm_start/skipped_steps": float(skipped_steps), "warm_start/seconds": time.perf_counter() - start,
    }
    log.info("warm start: %s", {k: round(v, 4) for k, v in figures.items()})
    return figures
