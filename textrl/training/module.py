"""The PPO LightningModule: one PPO iteration, top to bottom, in ``training_step``.

One Lightning epoch is one PPO iteration and has exactly one training step, which plays the
iteration's training games (``RolloutDataModule.games_for_iteration``) and reads as the algorithm:

1. rollout: play one episode per game with the current policy, sampling at this iteration's
   temperature, each episode with its own seed;
2. sequences and old log-probs: merge turns into sequences; under mixed precision recompute the
   old log-probs and values with the update's own forward;
3. advantages: GAE per turn (``textrl.ppo.advantages``);
4. update: ``ppo.epochs`` shuffled passes, each optimizer step the mean loss over its decisions,
   gradients clipped (LM and value head separately), the LR schedule stepped once;
5. metrics: logged at once, for this iteration.

Optimization is manual because gradient accumulation and clipping are PPO settings (Lightning
refuses them on the Trainer under manual optimization) and the LR schedule steps per iteration.
Evaluation is Lightning's validation loop: greedy play on the held-out games.
"""

from __future__ import annotations

import contextlib
import logging
import math
import resource
import time
from collections import defaultdict
from pathlib import Path

import lightning as L
import torch
from omegaconf import OmegaConf

from textrl.config import EnvConfig, PPOConfig, TrainConfig
from textrl.games.env import open_game
from textrl.games.pool import game_name
from textrl.games.workers import GameWorkers
from textrl.games.prompt import PromptBuilder
from textrl.policy.decoding import ConstrainedDecoder, masked_logprobs, score_commands
from textrl.policy.memory import make_optimizer
from textrl.policy.checkpoint import check_frozen, frozen_fingerprint, frozen_names
from textrl.policy.model import PolicyValueModel
from textrl.policy.frozen_prefix import FrozenPrefix
from textrl.policy.reference import ReferencePolicy
from textrl.ppo.buffer import Decisions, Sequence, add_advantages, decision_forward, episode_sequences, optimizer_steps
from textrl.ppo.losses import PPOTerms, correlation, explained_variance, ppo_loss
from textrl.rollout import Episode, RolloutStats, episode_metrics, episode_seeds, play
from textrl.training.datamodule import iteration_rng
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
        slim = cfg.model.trainable_layers is not None and not cfg.memory.lora and frozen_as_built
        self.frozen_keys = {f"policy.{n}" for n in frozen_names(policy)} if slim else set()
        self.frozen_fingerprint = frozen_fingerprint(policy) if slim else None
        self.strict_loading = not (cfg.memory.lora or slim)
        self.cfg = cfg
        self.policy = policy
        self.tokenizer = tokenizer
        self.prompts = PromptBuilder.for_env(tokenizer, cfg.env)
        # one decoder (KV cache) per group of games (env.decode_groups); at least two when games step on
        # workers (env.step_workers), so that one group's games step while the other decodes
        groups = max(cfg.env.decode_groups, 2 if cfg.env.step_workers else 1)
        self.decoders = [ConstrainedDecoder(policy) for _ in range(groups)]
        self.game_workers: GameWorkers | None = None  # env.step_workers processes, started at the first rollout
        self._probes: list | None = None  # (game, prompt, trie, walkthrough command), read at the first evaluation
        self._eval_episodes: list[list[Episode]] = [[], []]
        self._eval_start = 0.0
        self.iterations_done = 0  # completed PPO iterations (saved in checkpoints)
        self.uses_value = cfg.ppo.advantage == "gae"
        if not self.uses_value:
            log.info("ppo.advantage=%s: the value head is neither trained nor used", cfg.ppo.advantage)
        # the KL anchor's frozen initial policy (a buffer: checkpoints keep it); None without one
        self.reference = ReferencePolicy(policy.lm, cfg.memory.lora) if cfg.ppo.kl_coef > 0 else None
        # the frozen blocks under the trainable ones, run once per sequence per iteration (None: all
        # blocks train, or switched off)
        self.frozen = FrozenPrefix.of(policy.lm) if cfg.ppo.cache_frozen else None

    # ---- one PPO iteration ------------------------------------------------------------------
    def training_step(self, batch: str, batch_idx: int) -> None:
        cfg, p = self.cfg, self.cfg.ppo
        iteration = self.current_epoch
        data = self.trainer.datamodule
        games, env = data.games_for_iteration(iteration), data.train_env  # env: a curriculum's stage
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        temperature = temperature_at(p, iteration)
        lr_lm, lr_value = (g["lr"] for g in optimizer.param_groups)  # the rates this iteration uses

        # 1. Rollout: one episode per game, each sampled with its own seed
        start = time.perf_counter()
        seeds = episode_seeds(cfg.seed, iteration, games)
        episodes, stats = self.play(games, temperature=temperature, seeds=seeds, env=env)
        rollout_s = time.perf_counter() - start
        stage = data.stage
        if cfg.curriculum.stages or cfg.curriculum.replay:  # stages move on the win rate of all ranks' episodes
            won = self.trainer.strategy.reduce(torch.tensor([sum(e.won for e in episodes), len(episodes)],
                                                            dtype=torch.float32, device=self.device), reduce_op="sum")
            data.record(float(won[0] / won[1]), [e.game for e in episodes if not e.won])

        # 2. Sequences and the optimizer steps over them; the old log-probs and values
        per_episode = [episode_sequences(e) for e in episodes]
        sequences = self._equalize_across_ranks([s for seqs in per_episode for s in seqs])
        steps = optimizer_steps(sequences, p.minibatch_size, p.grad_accum, p.epochs, iteration_rng(cfg.seed, iteration))
        first_pass = steps[: len(steps) // p.epochs]  # every pass has the same number of steps
        start = time.perf_counter()
        recomputed = self._recompute_old(first_pass) if p.recompute_old else {}
        recompute_s = time.perf_counter() - start
        start = time.perf_counter()
        if self.reference is not None:  # the KL anchor's log-probs, fixed for the iteration
            self._reference_logprobs(first_pass)
        reference_s = time.perf_counter() - start

        # 3. Advantages: GAE per turn from the (possibly recomputed) old values, or group baselines
        add_advantages(episodes, per_episode, p.gamma, p.lam, p.normalize_advantages, p.advantage)

        # 4. Update: each optimizer step minimises the mean loss over its decisions
        start = time.perf_counter()
        sums: dict[str, float] = defaultdict(float)
        tokens = 0
        for s, (step, normalizer) in enumerate(zip(steps, self._step_normalizers(steps))):
            for m, minibatch in enumerate(step):
                terms, n_tokens = self._loss(minibatch, normalizer)
                self.manual_backward(terms.loss)
                tokens += n_tokens
                _accumulate(sums, terms)
                if s == 0 and m == 0:  # fresh data, unchanged weights: every ratio must be 1
                    sums["first_logratio_max"] = float(terms.log_ratio.abs().max())
                    sums["first_logratio_mean"] = float(terms.log_ratio.abs().mean())
            lm_norm, value_norm = self._clip_gradients(optimizer)
            sums["grad_norm"] += lm_norm
            sums["grad_norm_value"] += value_norm
            sums["steps"] += 1
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        update_s = time.perf_counter() - start

        # 5. Metrics of this iteration
        old_values = torch.tensor([v for s in sequences for v in s.old_values])
        returns = torch.tensor([r for s in sequences for r in s.returns])
        n, n_steps = max(sums["decisions"], 1.0), max(sums["steps"], 1.0)
        decode = stats.decode
        metrics = {
            **episode_metrics(episodes, "rollout"),
            "rollout/temperature": temperature,
            "rollout/decisions": float(stats.decisions),
            "rollout/decisions_per_s": stats.decisions_per_s,
            "loss/policy": sums["policy"] / n, "loss/entropy": sums["entropy"] / n,
            "loss/total": (sums["policy"] + (p.vf_coef * sums["value"] if self.uses_value else 0.0)
                           - p.ent_coef * sums["entropy"] + p.kl_coef * sums["kl_ref"]) / n,
            "policy/approx_kl": sums["approx_kl"] / n, "policy/clipfrac": sums["clipped"] / n,
            "policy/ratio_mean": sums["ratio"] / n,
            "policy/first_logratio_max": sums["first_logratio_max"],
            "policy/first_logratio_mean": sums["first_logratio_mean"],
            "optim/lr_lm": lr_lm, "optim/lr_value": lr_value,
            "optim/grad_norm": sums["grad_norm"] / n_steps, "optim/grad_norm_value": sums["grad_norm_value"] / n_steps,
            "perf/rollout_s": rollout_s, "perf/update_s": update_s, "perf/tokens_per_s": tokens / max(update_s, 1e-9),
            "perf/update_tokens": float(tokens),
            # where the rollout's time goes: the games, the model calls (prompts / fork levels), the
            # draws; the rest of perf/rollout_s is Python (prompts, tries, bookkeeping)
            "perf/rollout_env_s": stats.env_s, "perf/rollout_prefill_s": decode.prefill_s,
            "perf/rollout_fork_s": decode.fork_s, "perf/rollout_choose_s": decode.choose_s,
            "perf/rollout_tokens": float(decode.tokens),
            "perf/rollout_tokens_per_s": decode.tokens / max(decode.prefill_s + decode.fork_s, 1e-9),
            "perf/peak_mem_gb": peak_memory_gb(self.device), "iteration": float(iteration + 1),
        }
        if self.uses_value:
            metrics["loss/value"] = sums["value"] / n
            metrics["value/explained_variance"] = explained_variance(old_values, returns)
            metrics["value/corr"] = correlation(old_values, returns)
        if p.recompute_old:
            metrics["perf/recompute_s"] = recompute_s
            metrics["policy/rollout_logratio_max"] = recomputed["logratio_max"]
        if self.reference is not None:
            metrics["perf/reference_s"] = reference_s
            metrics["policy/kl_ref"] = sums["kl_ref"] / n
        if cfg.curriculum.replay and not cfg.env.repeatable:
            metrics["curriculum/replayed"] = float(data.replayed)  # this iteration's games that were recently lost ones
        if cfg.curriculum.stages:
            metrics["curriculum/stage"] = float(stage)  # the stage this iteration played
            if data.stage_win_rate is not None:  # what the next move is decided on (none right after a move)
                metrics["curriculum/stage_win_rate"] = data.stage_win_rate
        self.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=True)  # means over ranks
        self.log("rollout/episodes", float(len(episodes)), on_step=True, on_epoch=False, sync_dist=True,
                 reduce_fx="sum")
        self.iterations_done = iteration + 1

    # ---- the pieces training_step calls -------------------------------------------------------
    def play(self, games: list[Path], temperature: float = 1.0, seeds: list[int] | None = None,
             env: EnvConfig | None = None) -> tuple[list[Episode], RolloutStats]:
        """Sampled training episodes (with ``seeds``) or greedy evaluation episodes (without), of
        ``env``'s games (default: ``cfg.env``; a curriculum stage's otherwise)."""
        env = env or self.cfg.env
        if self.cfg.env.step_workers and self.game_workers is None:  # started once, at the first rollout
            self.game_workers = GameWorkers(self.cfg.env.step_workers)
        envs = self.game_workers.open(games, env) if self.game_workers else [open_game(g, env) for g in games]
        prompts = self.prompts if env is self.cfg.env else PromptBuilder.for_env(self.tokenizer, env)
        # the same autocast as the update (bf16-mixed etc.), so rollout and update compute one function
        precision = self._trainer.precision_plugin.forward_context() if self._trainer else contextlib.nullcontext()
        was_training = self.policy.training
        self.policy.eval()  # the function evaluation computes; gradient checkpointing acts in train mode only
        greedy = seeds is None
        for decoder in self.decoders:  # training rollouts keep the frozen blocks' outputs for the update
            decoder.capture = None if greedy else self.frozen
        try:
            # frozen weights cast once per rollout, not at every call (frozen_linears_in_autocast_dtype)
            with precision, self.policy.frozen_linears_in_autocast_dtype():
                return play(envs, self.decoders, prompts, temperature=temperature, greedy=greedy, seeds=seeds,
                            bootstrap=not greedy, explore=0.0 if greedy else self.cfg.ppo.explore)
        finally:
            self.policy.train(was_training)
            for env in envs:
                env.close()
            for decoder in self.decoders:
                decoder.reset()  # free the KV cache between rollouts

    def teardown(self, stage: str) -> None:
        if self.game_workers is not None:  # after fit / validate: the worker processes end with them
            self.game_workers.close()
            self.game_workers = None

    def _forward(self, batch: list[Sequence]) -> Decisions:
        return decision_forward(self.policy, batch, self.tokenizer.pad_token_id, self.frozen)

    def _flat(self, batch: list[Sequence], attr: str, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor([x for s in batch for x in getattr(s, attr)], dtype=dtype, device=self.device)

    def _loss(self, batch: list[Sequence], normalizer: float) -> tuple[PPOTerms, int]:
        p = self.cfg.ppo
        d = self._forward(batch)
        reference = None
        if self.reference is not None:  # the reference's log-probs of the same entries, -inf at the padding
            width = d.logits.shape[1]
            reference = torch.tensor([r + [float("-inf")] * (width - len(r)) for s in batch for r in s.ref_logprobs],
                                     device=self.device)
        terms = ppo_loss(d.logits, d.valid, d.chosen, self._flat(batch, "temperatures"),
                         self._flat(batch, "old_logprobs"), self._flat(batch, "advantages"), d.values,
                         self._flat(batch, "returns"), p.clip, p.vf_coef if self.uses_value else 0.0, p.ent_coef,
                         normalizer, p.kl_coef, reference, p.explore)
        return terms, d.fed

    def _decision_logprobs(self, minibatch: list[Sequence]) -> tuple[torch.Tensor, Decisions]:
        """No-grad forward: each decision's log-probs over its allowed tokens (at its temperature),
        and the forward's outputs."""
        d = self._forward(minibatch)
        temps = self._flat(minibatch, "temperatures")
        return masked_logprobs(d.logits / temps[:, None], d.valid, 1.0, self.cfg.ppo.explore), d

    @torch.no_grad()
    def _reference_logprobs(self, steps: list[list[list[Sequence]]]) -> None:
        """Store each decision's reference log-probs over its allowed tokens (``Sequence.ref_logprobs``)."""
        with self.reference.active(self.policy.lm):
            for minibatch in (mb for step in steps for mb in step):
                logp, _ = self._decision_logprobs(minibatch)
                rows = iter(logp.cpu().tolist())
                for s in minibatch:
                    s.ref_logprobs = [next(rows)[: len(a)] for a in s.allowed]

    @torch.no_grad()
    def _recompute_old(self, steps: list[list[list[Sequence]]]) -> dict[str, float]:
        """Replace the rollout's old log-probs and values with the update's own forward, over the
        first pass's minibatches (the same shapes the first update sees). Returns how far the
        rollout's log-probs were from them."""
        worst = 0.0
        for minibatch in (mb for step in steps for mb in step):
            logp, d = self._decision_logprobs(minibatch)
            logp = logp.gather(1, d.chosen[:, None]).squeeze(1).cpu()
            values = d.values.float().cpu()
            k = 0
            for s in minibatch:
                n = len(s.tokens)
                new = logp[k: k + n]
                worst = max(worst, float((new - torch.tensor(s.old_logprobs)).abs().max()))
                s.old_logprobs, s.old_values = new.tolist(), values[k: k + n].tolist()
                k += n
        return {"logratio_max": worst}

    def _step_normalizers(self, steps: list[list[list[Sequence]]]) -> list[float]:
        """Per optimizer step, the number of decisions it holds over all ranks, divided by the world
        size (DDP averages the ranks' gradients): the step's gradient is then the mean over its decisions."""
        counts = torch.tensor([float(sum(len(s.tokens) for mb in step for s in mb)) for step in steps],
                              device=self.device)
        world = self.trainer.world_size
        if world > 1:
            counts = self.trainer.strategy.reduce(counts, reduce_op="sum") / world
        return [max(float(c), 1e-9) for c in counts]

    def _equalize_across_ranks(self, sequences: list[Sequence]) -> list[Sequence]:
        """DDP needs the same number of backward passes on every rank: a rank with fewer sequences
        repeats some of its own (in order) up to the largest count."""
        if self.trainer.world_size == 1 or not sequences:
            return sequences
        count = self.trainer.strategy.reduce(torch.tensor(len(sequences), device=self.device), reduce_op="max")
        return [sequences[i % len(sequences)] for i in range(int(count))]

    def _clip_gradients(self, optimizer) -> tuple[float, float]:
        """Clip the LM's and the value head's gradient norms separately, each at ``max_grad_norm``:
        clipped together, the larger one (usually the LM's) would scale the other down, and
        ``vf_coef`` would act only through the clip. Returns both norms before clipping."""
        # fp16: gradients are still multiplied by the loss scale here (the precision plugin
        # unscales inside step()); clipping the scaled norm at max_norm * scale is the same clip
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        scale = float(scaler.get_scale()) if scaler is not None else 1.0
        max_norm = self.cfg.ppo.max_grad_norm * scale
        lm, value = (group["params"] for group in optimizer.param_groups)
        return (float(torch.nn.utils.clip_grad_norm_(lm, max_norm)) / scale,
                float(torch.nn.utils.clip_grad_norm_(value, max_norm)) / scale)

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
        self._eval_start = time.perf_counter()

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        # the fixed training games (loader 1) are the current curriculum stage's
        env = self.trainer.datamodule.train_env if dataloader_idx == 1 else None
        self._eval_episodes[dataloader_idx] += self.play(batch, env=env)[0]

    def on_validation_epoch_end(self):
        # inside fit, validation follows the update of epoch k (iteration k + 1); a stand-alone
        # validate() runs before fit (iteration 0) or after it (current_epoch == iterations done)
        iteration = self.current_epoch + (1 if self.trainer.state.fn == "fit" else 0)
        episodes, train_episodes = self._eval_episodes
        metrics = episode_metrics(episodes, "eval")
        # the first decision of a command is mostly its verb: how sure the policy is of it
        first = [s.action.decisions[0].entropy for e in episodes for s in e.steps if s.action.decisions]
        metrics["eval/first_fork_entropy"] = sum(first) / max(len(first), 1)
        if train_episodes:
            train = episode_metrics(train_episodes, "eval")
            metrics["eval/train_win_rate"] = train["eval/win_rate"]
            metrics["eval/train_episode_len"] = train["eval/episode_len"]
        if self.cfg.eval.probes:
            metrics.update(self._probe_metrics())
        metrics["iteration"] = float(iteration)
        metrics["perf/eval_s"] = time.perf_counter() - self._eval_start
        self.log_dict(metrics, on_epoch=True, sync_dist=True)
        self.log("eval/games", float(len(episodes)), on_epoch=True, sync_dist=True, reduce_fx="sum")
        if self.cfg.eval.transcripts and self.trainer.is_global_zero:
            shown = episodes[: self.cfg.eval.transcripts]
            with self._trainer.precision_plugin.forward_context():  # the alternatives: one forward per step
                rows = transcript_rows(shown, self.policy, self.prompts)
            path = Path(self.cfg.output_dir) / "transcripts" / f"iter_{iteration:04d}.md"
            text = write_transcripts(shown, path, f"Greedy evaluation after iteration {iteration}: win rate "
                                     f"{metrics['eval/win_rate']:.2f} on {len(episodes)} games", rows)
            log_transcripts(self.logger, rows, text, iteration)

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


def _accumulate(sums: dict[str, float], terms: PPOTerms) -> None:
    for key in ("policy", "value", "entropy", "approx_kl", "clipped", "ratio", "kl_ref"):
        sums[key] += float(getattr(terms, key))
    sums["decisions"] += terms.log_ratio.numel()


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
