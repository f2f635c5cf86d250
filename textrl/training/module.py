"""The PPO LightningModule: Lightning glue around one PPO iteration.

One Lightning epoch is one PPO iteration and has exactly one training step, which reads as the
algorithm: play the iteration's training games (``play_games``, each episode sampled with its own
seed), report their outcome to the curriculum, update the policy on them (``PPOUpdate.run``:
sequences, old log-probs, advantages, epochs of optimizer steps), step the LR schedule, log.

Optimization is manual because gradient accumulation and clipping are PPO settings (Lightning
refuses them on the Trainer under manual optimization) and the LR schedule steps per iteration.
Evaluation is Lightning's validation loop: greedy play on the held-out games.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ParallelStrategy
from omegaconf import OmegaConf

from textrl.config import PPOConfig, TrainConfig
from textrl.failures import failure_counts
from textrl.games.env import open_game
from textrl.games.pool import game_name
from textrl.games.workers import GameWorkers
from textrl.games.prompt import PromptBuilder
from textrl.policy.checkpoint import check_frozen, frozen_fingerprint, frozen_names, leaves_frozen_weights_out
from textrl.policy.decoding import ConstrainedDecoder, score_commands
from textrl.policy.speed import FrozenPrefix
from textrl.policy.memory import make_optimizer
from textrl.policy.model import PolicyValueModel
from textrl.policy.reference import ReferencePolicy
from textrl.ppo.update import PPOUpdate, Runtime
from textrl.results import summarize
from textrl.rollout import Episode, Player, Sampling, check_aborted, episode_seeds, play_games
from textrl.training.curriculum import Curriculum, IterationGames
from textrl.training.loggers import log_transcripts
from textrl.transcripts import transcript_rows, write_transcripts

log = logging.getLogger(__name__)


def temperature_at(ppo: PPOConfig, iteration: int) -> float:
    """The sampling temperature of iteration ``iteration`` (0-based): T0 x decay^iteration, floored."""
    return max(ppo.temperature_min, ppo.temperature * ppo.temperature_decay ** iteration)


def lr_factor(iteration: int, iterations: int, floor: float) -> float:
    """The LM's cosine schedule: 1 at the first iteration, ``floor`` at the last one."""
    if iterations <= 1:
        return 1.0
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(iteration, iterations - 1) / (iterations - 1)))


class PPOModule(L.LightningModule):
    def __init__(self, cfg: TrainConfig, policy: PolicyValueModel, tokenizer, frozen_as_built: bool = True):
        super().__init__()
        self.automatic_optimization = False
        # checkpoints hold what training changes: LoRA's adapters, or with model.trainable_layers the
        # trainable blocks; the frozen weights come from the model config (checked by fingerprint)
        # (``frozen_as_built=False``: model.init_from brought other frozen weights, which must be saved)
        slim = leaves_frozen_weights_out(cfg) and frozen_as_built
        self.frozen_keys = {f"policy.{n}" for n in frozen_names(policy)} if slim else set()
        self.frozen_fingerprint = frozen_fingerprint(policy) if slim else None
        self.strict_loading = not (cfg.memory.lora or slim)
        self.cfg = cfg
        self.policy = policy
        self.tokenizer = tokenizer
        self.prompts = PromptBuilder.for_env(tokenizer, cfg.env)
        self._probes: list | None = None  # (game, prompt, trie, walkthrough command), read at the first evaluation
        self._eval_episodes: list[list[Episode]] = [[], []]
        self._eval_start = 0.0
        self.iterations_done = 0  # completed PPO iterations (saved in checkpoints)
        if cfg.ppo.advantage != "gae":
            log.info("ppo.advantage=%s: the value head is neither trained nor used", cfg.ppo.advantage)
        # the KL anchor's initial policy (a buffer: checkpoints keep it); None without one
        self.reference = ReferencePolicy(policy.lm, cfg.memory.lora) if cfg.ppo.kl_coef > 0 else None
        # ... which DDP leaves alone: it would broadcast every buffer from rank 0 before each
        # training_step (the reference copy of a full Qwen fine-tune: ~2 GB per iteration), and
        # every rank builds the same copy from the same weights (or loads it from the checkpoint)
        self._ddp_params_and_buffers_to_ignore = [f"reference.{n}" for n, _ in self.reference.named_buffers()] \
            if self.reference is not None else []
        # the frozen blocks under the trainable ones, run once per sequence per iteration (None: all
        # blocks train, or switched off)
        frozen = FrozenPrefix.of(policy.lm) if cfg.ppo.cache_frozen else None
        # one decoder (KV cache) per group of games (env.decode_groups); at least two when games step on
        # workers (env.step_workers), so that one group's games step while the other decodes
        groups = max(cfg.env.decode_groups, 2 if cfg.env.step_workers else 1)
        decoders = [ConstrainedDecoder(policy, capture=frozen, drop_cut_turns=cfg.env.drop_turns_from_cache)
                     for _ in range(groups)]  # every stage's games and the evaluation's share env's setting
        self.player = Player(policy, tokenizer, decoders, autocast=self._autocast)
        self.update = PPOUpdate(policy, cfg.ppo, tokenizer.pad_token_id, cfg.seed, reference=self.reference,
                                frozen=frozen, runtime=Runtime(backward=self.manual_backward,
                                                               all_reduce=self._all_reduce,
                                                               world_size=self._world_size,
                                                               loss_scale=self._loss_scale,
                                                               no_sync=self._no_sync))

    # ---- one PPO iteration ------------------------------------------------------------------
    def training_step(self, curriculum: Curriculum, batch_idx: int) -> None:
        iteration = self.current_epoch
        played = curriculum.games(iteration, self.global_rank, self.trainer.world_size)
        temperature = temperature_at(self.cfg.ppo, iteration)
        optimizer = self.optimizers()
        lr_lm, lr_value = (g["lr"] for g in optimizer.param_groups)  # the rates this iteration uses

        explore = self.cfg.ppo.explore  # the update trains this same mixture (PPOUpdate.prepare)
        sampling = Sampling(temperature, episode_seeds(self.cfg.seed, iteration, played.games), explore)
        episodes, rollout_stats = play_games(self.player, played.games, played.env, sampling)
        episodes, aborted = self._completed(episodes, played.env.max_aborted, "training")  # game faults: left out
        outcome = self._all_ranks_metrics(episodes, "rollout")  # every rank reduces, whatever its share
        if curriculum.needs_outcomes:  # stages move on the win rate of all ranks' episodes
            lost = self._all_ranks_lost([e.game for e in episodes if not e.won], played)
            curriculum.record(outcome["rollout/win_rate"], lost)
        stats = self.update.run(episodes, iteration, optimizer)
        self.lr_schedulers().step()

        self.log_dict({**outcome, "rollout/temperature": temperature, "rollout/explore": explore,
                       **rollout_stats.metrics(), **stats.metrics(), **curriculum.metrics(played),
                       "optim/lr_lm": lr_lm, "optim/lr_value": lr_value,
                       "perf/peak_mem_gb": peak_memory_gb(self.device), "iteration": float(iteration + 1)},
                      on_step=True, on_epoch=False, sync_dist=True)  # means over ranks
        self.log("rollout/episodes", float(len(episodes)), on_step=True, on_epoch=False, sync_dist=True,
                 reduce_fx="sum")
        self.log("rollout/aborted", float(aborted), on_step=True, on_epoch=False, sync_dist=True, reduce_fx="sum")
        self.iterations_done = iteration + 1

    def _all_ranks_metrics(self, episodes: list[Episode], prefix: str, entropy: bool = False) -> dict[str, float]:
        """``<prefix>/win_rate``, ``episode_len``, ``return`` (means over episodes) and ``repeats``
        (the share of turns that repeat a command from the same state, ``Episode.repeats``) over all
        ranks' episodes, in one reduction that every rank joins (a rank with no episode too): the same
        figures on every rank, weighted by episodes (a mean of the ranks' means would weigh a rank's
        few episodes like another's many). ``entropy``: also
        ``<prefix>/first_fork_entropy``, the mean entropy of each command's first decision."""
        first = [s.action.decisions[0].entropy for e in episodes for s in e.steps if s.action.decisions]
        sums = self._all_reduce(torch.tensor(
            [len(episodes), sum(e.won for e in episodes), sum(e.length for e in episodes),
             sum(e.total_return for e in episodes), sum(first), len(first), sum(e.repeats for e in episodes)],
            dtype=torch.float64, device=self.device), "sum").tolist()
        n = max(sums[0], 1.0)
        out = {f"{prefix}/win_rate": sums[1] / n, f"{prefix}/episode_len": sums[2] / n, f"{prefix}/return": sums[3] / n,
               f"{prefix}/repeats": sums[6] / max(sums[2], 1.0)}  # a share of all turns
        if entropy:
            out[f"{prefix}/first_fork_entropy"] = sums[4] / max(sums[5], 1.0)
        return out

    def _failure_metrics(self, episodes: list[Episode]) -> dict[str, float]:
        """``eval/failures/<kind>``: the share of all ranks' held-out episodes that failed that way
        (``textrl.failures``; with ``eval/win_rate`` they add up to 1), one reduction every rank joins."""
        counts = failure_counts(episodes)
        sums = self._all_reduce(torch.tensor([len(episodes), *counts.values()], dtype=torch.float64,
                                             device=self.device), "sum").tolist()
        return {f"eval/failures/{kind}": c / max(sums[0], 1.0) for kind, c in zip(counts, sums[1:])}

    def _completed(self, episodes: list[Episode], max_aborted: float, what: str) -> tuple[list[Episode], int]:
        """The episodes no game fault aborted, and how many were; more than ``max_aborted`` of all
        ranks' episodes aborted stops the run, on every rank alike."""
        kept = [e for e in episodes if e.aborted is None]
        counts = self._all_reduce(torch.tensor([len(episodes) - len(kept), len(episodes)], dtype=torch.float32,
                                               device=self.device), "sum")
        check_aborted(*counts.tolist(), max_aborted, what)
        return kept, len(episodes) - len(kept)

    # ---- what the pieces need from Lightning ------------------------------------------------
    def _autocast(self):
        """The autocast of the run's precision (bf16-mixed etc.): rollouts compute the update's function."""
        return self._trainer.precision_plugin.forward_context() if self._trainer else contextlib.nullcontext()

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return self.trainer.strategy.reduce(tensor, reduce_op=op)

    def _world_size(self) -> int:
        return self._trainer.world_size if self._trainer else 1  # no Trainer: one process

    def _no_sync(self) -> contextlib.AbstractContextManager:
        """DDP's ``no_sync`` (Lightning's ``block_backward_sync``): backward without the gradient
        all-reduce; a plain context for one process."""
        strategy = self._trainer.strategy if self._trainer else None
        return strategy.block_backward_sync() if isinstance(strategy, ParallelStrategy) else contextlib.nullcontext()

    def _loss_scale(self) -> float | None:
        scaler = getattr(self._trainer.precision_plugin, "scaler", None) if self._trainer else None  # 16-mixed only
        return float(scaler.get_scale()) if scaler is not None else None

    def setup(self, stage: str) -> None:
        if self.cfg.env.step_workers and self.player.workers is None:  # for fit / validate; teardown ends them
            self.player.workers = GameWorkers(self.cfg.env.step_workers)

    def on_fit_start(self) -> None:
        # DDP leaves the KL reference out of its broadcasts (__init__): rank 0's, once, as DDP does
        # with the weights when it wraps the model (a warm start on a GPU may differ by rank)
        if self.reference is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            for buffer in self.reference.buffers():
                torch.distributed.broadcast(buffer, src=0)

    def teardown(self, stage: str) -> None:
        self.player.close()

    def configure_optimizers(self):
        p = self.cfg.ppo
        optimizer = make_optimizer([q for q in self.policy.lm.parameters() if q.requires_grad],
                                   list(self.policy.value_head.parameters()), self.cfg.memory,
                                   p.lr_lm, p.lr_value, p.weight_decay)
        total, floor = self.cfg.iterations, p.lr_lm_min / p.lr_lm
        # stepped once per iteration by training_step (manual optimization: Lightning does not step it)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda it: lr_factor(it, total, floor),
                                                                  lambda it: 1.0])
        return [optimizer], [scheduler]

    # ---- evaluation -----------------------------------------------------------------------
    def on_validation_epoch_start(self):
        self._eval_episodes = [[], []]  # held-out games, fixed training games
        self._sampled_episodes = []  # held-out games sampled at eval.temperature (if set): eval/sampled/*
        self._eval_start = time.perf_counter()

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        games, env = batch  # the held-out games (loader 0), or fixed training games of the current stage (1)
        self._eval_episodes[dataloader_idx] += play_games(self.player, games, env)[0]
        if self.cfg.eval.temperature is not None and dataloader_idx == 0:  # beside greedy, never instead of it
            sampling = Sampling(self.cfg.eval.temperature, episode_seeds(self.cfg.seed, self.iterations_done, games))
            self._sampled_episodes += play_games(self.player, games, env, sampling)[0]

    def on_validation_epoch_end(self):
        iteration = self.iterations_done  # the policy after this many iterations
        (episodes, aborted), (train_episodes, train_aborted) = (  # game faults: left out, counted
            self._completed(e, self.cfg.env.max_aborted, "evaluation") for e in self._eval_episodes)
        # over all ranks' games, reduced by every rank (some may have played none); the first decision
        # of a command is mostly its verb: first_fork_entropy is how sure the policy is of it
        metrics = self._all_ranks_metrics(episodes, "eval", entropy=True)
        if self.cfg.eval.train_games:
            train = self._all_ranks_metrics(train_episodes, "eval")
            metrics["eval/train_win_rate"] = train["eval/win_rate"]
            metrics["eval/train_episode_len"] = train["eval/episode_len"]
        metrics.update(self._failure_metrics(episodes))
        if self.cfg.eval.temperature is not None:
            sampled, _ = self._completed(self._sampled_episodes, self.cfg.env.max_aborted, "evaluation")
            metrics.update(self._all_ranks_metrics(sampled, "eval/sampled"))
        if self.cfg.eval.probes:
            metrics.update(self._probe_metrics())
        metrics["iteration"] = float(iteration)
        metrics["perf/eval_s"] = time.perf_counter() - self._eval_start
        self.log_dict(metrics, on_epoch=True, sync_dist=True)
        self.log("eval/games", float(len(episodes)), on_epoch=True, sync_dist=True, reduce_fx="sum")
        self.log("eval/aborted", float(aborted + train_aborted), on_epoch=True, sync_dist=True, reduce_fx="sum")
        held_out = self._all_ranks_episodes(self._eval_episodes[0])  # a collective: every rank joins
        if self.trainer.is_global_zero and any(e.aborted is None for e in held_out):
            self._write_evaluation(held_out, iteration)
        if self.cfg.eval.transcripts and self.trainer.is_global_zero:
            shown = episodes[: self.cfg.eval.transcripts]
            with self._trainer.precision_plugin.forward_context():  # the alternatives: one forward per step
                rows = transcript_rows(shown, self.policy, self.prompts)
            path = Path(self.cfg.output_dir) / "transcripts" / f"iter_{iteration:04d}.md"
            text = write_transcripts(shown, path, f"Greedy evaluation after iteration {iteration}: win rate "
                                     f"{metrics['eval/win_rate']:.2f} on {len(episodes)} games", rows)
            log_transcripts(self.logger, rows, text, iteration)

    def _all_ranks_episodes(self, episodes: list[Episode]) -> list[Episode]:
        """Every rank's episodes (each rank played its share of the held-out games), in the games' order."""
        if self._world_size() == 1:
            return episodes
        order = {game_name(p): k for k, p in enumerate(self.trainer.datamodule.eval_games)}
        return sorted(self._gathered(episodes), key=lambda e: order.get(game_name(e.game), len(order)))

    def _all_ranks_lost(self, lost: list[str], played: IterationGames) -> list[str]:
        """Every rank's lost training games of the iteration, in the order of its games on all ranks
        (one process's order), so that every rank records the same list."""
        if self._world_size() == 1:
            return lost
        order = {str(g): k for k, g in enumerate(played.every_rank)}
        return sorted(self._gathered(lost), key=lambda g: order.get(str(g), len(order)))

    def _gathered(self, items: list) -> list:
        """Every rank's ``items``, rank 0's first (``all_gather_object``: one host sync)."""
        parts: list = [None] * self._world_size()
        torch.distributed.all_gather_object(parts, items)
        return [x for part in parts for x in part]

    def _write_evaluation(self, episodes: list[Episode], iteration: int) -> None:
        """``evaluation/iter_<k>.json``: the held-out evaluation after iteration k as ``textrl-eval``
        writes its ``results.json`` (``textrl.results``: every game, 95% intervals, how the games not
        won failed), so a run's final evaluation need not be played again (``bench/families.py``)."""
        summary = {"policy": f"run:{self.cfg.output_dir}", "iteration": iteration, "env": self.cfg.env.name,
                   "trained_on": self.cfg.env.name, "max_steps": self.cfg.env.max_steps, "greedy": True,
                   "precision": str(self.trainer.precision), **summarize(episodes)}
        path = Path(self.cfg.output_dir) / "evaluation" / f"iter_{iteration:04d}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".json.tmp")  # renamed when complete: a kill leaves no half-written file
        partial.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(partial, path)

    def _probe_metrics(self) -> dict[str, float]:
        """The probability (T = 1) the policy gives each probe game's walkthrough first command at
        the game's opening observation: whether it learns to read objectives, long before the
        held-out win rate moves. Probes are the first ``eval.probes`` held-out games (a game whose
        walkthrough does not start with an admissible command is left out)."""
        if self._probes is None:
            self._probes = []
            for path in self.trainer.datamodule.eval_games[: self.cfg.eval.probes]:
                game = open_game(path, self.cfg.env)
                obs = game.reset()
                if game.walkthrough and game.walkthrough[0] in obs.admissible_commands:
                    trie = self.prompts.trie(obs)
                    self._probes.append((game_name(path), self.prompts.build(obs, []), trie, game.walkthrough[0]))
                game.close()
        with self._trainer.precision_plugin.forward_context():
            p = {f"probe/{name}": score_commands(self.policy, prompt, trie)[command]
                 for name, prompt, trie, command in self._probes}
        return {**p, "probe/mean": sum(p.values()) / max(len(p), 1)}

    # ---- checkpoint state beyond weights/optimizer/scheduler ----------------------------------
    def on_save_checkpoint(self, checkpoint):
        # Nothing random needs saving: sampling seeds, game order and minibatch order all derive
        # from (seed, iteration), and the temperature from the iteration.
        if self.cfg.memory.lora:  # adapters + value head only: the frozen base comes from the model config
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items()
                                        if "lora_" in k or k.startswith("policy.value_head.")}
        elif self.frozen_keys:  # the trainable blocks, value head and buffers
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k not in self.frozen_keys}
            checkpoint.setdefault("textrl", {})["frozen"] = {"fingerprint": self.frozen_fingerprint}
        checkpoint.setdefault("textrl", {}).update({
            "config": OmegaConf.to_container(OmegaConf.structured(self.cfg)),
            "iterations_done": self.iterations_done,
        })

    def on_load_checkpoint(self, checkpoint):
        self.iterations_done = checkpoint["textrl"]["iterations_done"]
        if "frozen" in checkpoint["textrl"]:
            check_frozen(checkpoint, self.frozen_fingerprint or "", f"ckpt_path={self.cfg.ckpt_path}")
        elif self.frozen_keys and frozen_fingerprint(self.policy, checkpoint["state_dict"], "policy.") != self.frozen_fingerprint:
            self.frozen_keys = set()  # a full checkpoint with other frozen weights (model.init_from): keep saving them


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
