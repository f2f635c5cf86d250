"""The PPO LightningModule: rollouts come from the DataModule, updates happen here.

One Lightning epoch is one PPO iteration. ``training_step`` receives a minibatch of sequences
(prompt + command tokens of consecutive turns, see ``textrl.ppo.buffer``), runs one forward per
sequence, reads the logits and values at the decision positions and applies the clipped PPO loss.
Optimization is manual because gradient accumulation and clipping are PPO settings (Lightning
refuses them on the Trainer under manual optimization) and the LR schedule steps per iteration.
"""

from __future__ import annotations

import contextlib
import math
import random
import resource
import time
from collections import defaultdict
from pathlib import Path

import lightning as L
import torch
from omegaconf import OmegaConf

from textrl.config import TrainConfig
from textrl.games.env import TextGame
from textrl.games.pool import DIFFICULTIES
from textrl.games.prompt import PromptBuilder
from textrl.policy.decoding import ConstrainedDecoder
from textrl.policy.memory import make_optimizer
from textrl.policy.model import PolicyValueModel
from textrl.ppo.buffer import Sequence
from textrl.ppo.losses import ppo_loss
from textrl.rollout import Episode, episode_metrics, play
from textrl.transcripts import write_transcripts


def disable_dropout(model: torch.nn.Module) -> None:
    """PPO's ratio is 1 on fresh data only if the update sees the rollout's exact function."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for key in list(vars(config)) if config is not None else []:
        if ("dropout" in key or "pdrop" in key) and isinstance(getattr(config, key), float):
            setattr(config, key, 0.0)


class PPOModule(L.LightningModule):
    def __init__(self, cfg: TrainConfig, policy: PolicyValueModel, tokenizer):
        super().__init__()
        self.automatic_optimization = False
        self.strict_loading = not cfg.memory.lora  # LoRA checkpoints leave out the frozen base weights
        self.rollout_episodes = 0.0
        self.cfg = cfg
        self.policy = policy
        disable_dropout(policy.lm)
        self.tokenizer = tokenizer
        self.prompts = PromptBuilder(tokenizer, cfg.env.max_prompt_tokens, cfg.env.list_commands)
        self.decoder = ConstrainedDecoder(policy, tokenizer.pad_token_id)
        self.max_steps = cfg.env.max_steps or DIFFICULTIES[cfg.env.difficulty].max_steps
        self.temperature = cfg.ppo.temperature  # decayed by the TemperatureSchedule callback
        self.sampler = torch.Generator().manual_seed(cfg.seed)  # rollout sampling only
        self.rollout_metrics: dict[str, float] = {}
        self._stats: dict[str, list[float]] = defaultdict(list)
        self._micro = 0
        self._update_start = 0.0
        self._update_tokens = 0
        self._eval_episodes: list[Episode] = []

    # ---- rollouts -------------------------------------------------------------------------
    def play(self, games: list[Path], greedy: bool) -> list[Episode]:
        envs = [TextGame(g, self.max_steps, self.cfg.env.step_penalty, self.cfg.env.win_bonus,
                         self.cfg.env.history_len) for g in games]
        # the same autocast as the update (bf16-mixed etc.), so rollout and update compute one function
        precision = self._trainer.precision_plugin.forward_context() if self._trainer else contextlib.nullcontext()
        was_training = self.policy.training
        self.policy.eval()  # gradient checkpointing (train mode only) would switch the KV cache off
        try:
            with precision:
                episodes, stats = play(envs, self.decoder, self.prompts, temperature=self.temperature,
                                       greedy=greedy, generator=self.sampler)
        finally:
            self.policy.train(was_training)
            for env in envs:
                env.close()
            self.decoder.reset()  # free the KV cache between rollouts
        self._last_play = stats
        return episodes

    # ---- update ---------------------------------------------------------------------------
    def configure_optimizers(self):
        p = self.cfg.ppo
        optimizer = make_optimizer([q for q in self.policy.lm.parameters() if q.requires_grad],
                                   list(self.policy.value_head.parameters()), self.cfg.memory,
                                   p.lr_lm, p.lr_value, p.weight_decay)
        total, floor = self.cfg.iterations, p.lr_lm_min / p.lr_lm

        def cosine(it: int) -> float:  # LM: cosine from lr_lm to lr_lm_min over the run
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(it, total) / total))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [cosine, lambda it: 1.0])
        return [optimizer], [{"scheduler": scheduler, "interval": "epoch"}]

    def _forward(self, batch: list[Sequence]):
        device = self.device
        width = max(len(s.input_ids) for s in batch)
        ids = torch.full((len(batch), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, s in enumerate(batch):  # right padding: positions are plain 0..n-1, as in the rollout
            ids[r, : len(s.input_ids)] = torch.tensor(s.input_ids)
            mask[r, : len(s.input_ids)] = 1
        positions = torch.arange(width)[None].expand_as(ids)
        hidden, _ = self.policy.hidden(ids.to(device), mask.to(device), positions.to(device))
        rows = torch.tensor([r for r, s in enumerate(batch) for _ in s.positions], device=device)
        cols = torch.tensor([c for s in batch for c in s.positions], device=device)
        h = hidden[rows, cols]
        logits = self.policy.logits(h)
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        for i, a in enumerate(a for s in batch for a in s.allowed):
            allowed[i, a] = True
        return logits, allowed, self.policy.value(h), int(mask.sum())

    def training_step(self, batch, batch_idx):
        if batch.first:
            self._update_start = time.perf_counter()
        sequences = batch.sequences
        p = self.cfg.ppo
        logits, allowed, values, n_tokens = self._forward(sequences)

        def flat(attr, dtype=torch.float32):
            return torch.tensor([x for s in sequences for x in getattr(s, attr)], dtype=dtype, device=self.device)

        terms = ppo_loss(logits, allowed, flat("tokens", torch.long), flat("temperatures"), flat("old_logprobs"),
                         flat("advantages"), values, flat("returns"), p.clip, p.vf_coef, p.ent_coef)
        self.manual_backward(terms.total / p.grad_accum)
        self._micro += 1
        self._update_tokens += n_tokens
        if batch.first:  # fresh data, unchanged weights: the ratio must be exactly 1
            self._stats["first_ratio_dev"].append(float((terms.ratio_mean - 1).abs()))
        for key in ["total", "policy", "value", "entropy", "approx_kl", "clipfrac", "ratio_mean"]:
            self._stats[key].append(float(getattr(terms, key).detach()))
        if self._micro % p.grad_accum == 0 or batch.last:
            optimizer = self.optimizers()
            params = [q for group in optimizer.param_groups for q in group["params"]]
            # fp16: gradients are still multiplied by the loss scale here (the precision plugin
            # unscales inside step()); clipping the scaled norm at max_norm * scale is the same clip
            scaler = getattr(self.trainer.precision_plugin, "scaler", None)
            scale = float(scaler.get_scale()) if scaler is not None else 1.0
            norm = torch.nn.utils.clip_grad_norm_(params, p.max_grad_norm * scale) / scale
            self._stats["grad_norm"].append(float(norm))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self._micro = 0

    def on_train_epoch_end(self):
        update_s = time.perf_counter() - self._update_start
        scheduler = self.lr_schedulers()
        groups = self.optimizers().param_groups
        metrics = dict(self.rollout_metrics)
        names = {"total": "loss/total", "policy": "loss/policy", "value": "loss/value", "entropy": "loss/entropy",
                 "approx_kl": "policy/approx_kl", "clipfrac": "policy/clipfrac", "ratio_mean": "policy/ratio_mean",
                 "first_ratio_dev": "policy/first_ratio_dev", "grad_norm": "optim/grad_norm"}
        for key, values in self._stats.items():
            metrics[names[key]] = sum(values) / len(values)
        metrics.update({
            "optim/lr_lm": groups[0]["lr"], "optim/lr_value": groups[1]["lr"], "rollout/temperature": self.temperature,
            "perf/update_s": update_s, "perf/tokens_per_s": self._update_tokens / max(update_s, 1e-9),
            "perf/peak_mem_gb": peak_memory_gb(self.device), "iteration": float(self.current_epoch + 1),
        })
        self.log_dict(metrics, on_epoch=True, sync_dist=True)  # means over ranks
        self.log("rollout/episodes", self.rollout_episodes, on_epoch=True, sync_dist=True, reduce_fx="sum")
        self._stats.clear()
        self._update_tokens = 0
        scheduler.step()

    # ---- evaluation -----------------------------------------------------------------------
    def on_validation_epoch_start(self):
        self._eval_episodes = []

    def validation_step(self, batch, batch_idx):
        self._eval_episodes += self.play(batch, greedy=True)

    def on_validation_epoch_end(self):
        # inside fit, validation follows the update of epoch k (iteration k + 1); a stand-alone
        # validate() runs before fit (iteration 0) or after it (current_epoch == iterations done)
        iteration = self.current_epoch + (1 if self.trainer.state.fn == "fit" else 0)
        episodes = self._eval_episodes
        metrics = episode_metrics(episodes, "eval")
        metrics["iteration"] = float(iteration)
        self.log_dict(metrics, on_epoch=True, sync_dist=True)
        self.log("eval/games", float(len(episodes)), on_epoch=True, sync_dist=True, reduce_fx="sum")
        if self.cfg.eval.transcripts and self.trainer.is_global_zero:
            path = Path(self.cfg.output_dir) / "transcripts" / f"iter_{iteration:04d}.md"
            write_transcripts(episodes[: self.cfg.eval.transcripts], path,
                              f"Greedy evaluation after iteration {iteration}: win rate "
                              f"{metrics['eval/win_rate']:.2f} on {len(episodes)} games")

    # ---- checkpoint state beyond weights/optimizer/scheduler ----------------------------------
    def on_save_checkpoint(self, checkpoint):
        if self.cfg.memory.lora:  # adapters + value head only: the frozen base comes from the model config
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items()
                                        if "lora_" in k or k.startswith("policy.value_head.")}
        checkpoint.setdefault("textrl", {}).update({
            "config": OmegaConf.to_container(OmegaConf.structured(self.cfg)),
            "temperature": self.temperature,
            "sampler": self.sampler.get_state(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        })

    def on_load_checkpoint(self, checkpoint):
        state = checkpoint["textrl"]
        self.temperature = state["temperature"]
        self.sampler.set_state(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
