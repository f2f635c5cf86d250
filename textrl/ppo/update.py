"""One PPO update, top to bottom: what happens to a rollout's episodes.

``PPOUpdate.run`` reads as the algorithm: episodes -> training sequences -> old log-probs and values
(recomputed with the update's own forward under mixed precision) -> the KL anchor's log-probs ->
advantages -> ``ppo.epochs`` shuffled passes of optimizer steps, each the mean loss over its
decisions, gradients clipped -> statistics (``IterationStats``, which knows its metric names).

It is a plain object: the LightningModule hands it Lightning's backward and cross-rank reduction
(``Runtime``); a test or a script can run it with the defaults, one process and plain backward.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch

from textrl.config import PPOConfig
from textrl.errors import NonFiniteError
from textrl.policy.distribution import fork_logprobs
from textrl.policy.frozen_prefix import FrozenPrefix
from textrl.policy.model import PolicyValueModel
from textrl.policy.reference import ReferencePolicy
from textrl.ppo.advantages import rollout_advantages
from textrl.ppo.losses import DecisionBatch, LossCoefs, PPOTerms, correlation, explained_variance, ppo_loss
from textrl.ppo.sequences import (ForkOutputs, PrefixOutputs, RolloutDecisions, TrainingSequence, decision_forward,
                                  decision_indices, optimizer_steps, training_sequences)
from textrl.rollout import Episode, iteration_rng

log = logging.getLogger(__name__)

Minibatch = list[TrainingSequence]
OptimizerStep = list[Minibatch]  # the minibatches one optimizer step accumulates


@dataclass
class Runtime:
    """What the update needs from the training loop around it. The defaults are one process and a
    plain ``backward``; the LightningModule passes its precision-aware backward and its strategy's
    reductions."""

    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward
    all_reduce: Callable[[torch.Tensor, str], torch.Tensor] = lambda tensor, op: tensor  # op: "sum" | "max"
    world_size: Callable[[], int] = lambda: 1
    # fp16 loss scaling: gradients are still multiplied by the scale when they are clipped, and the
    # scaler skips steps with non-finite gradients itself; None without a scaler
    loss_scale: Callable[[], float | None] = lambda: None


@dataclass
class Targets:
    """What one iteration's loss compares against, fixed before the first optimizer step: flat over
    the rollout's decisions (``TrainingSequence.decisions`` indexes them)."""

    old_logprobs: torch.Tensor  # [decisions]
    old_values: torch.Tensor  # [decisions]
    advantages: torch.Tensor  # [decisions]
    returns: torch.Tensor  # [decisions]
    temperatures: torch.Tensor  # [decisions]
    ref_logprobs: torch.Tensor | None = None  # [decisions, widest fork], -inf at the padding


@dataclass
class IterationData:
    """One iteration's training data, ready for the optimizer steps (``PPOUpdate.prepare``)."""

    rollout: RolloutDecisions
    steps: list[OptimizerStep]  # every pass's optimizer steps, in order
    targets: Targets
    prefix: PrefixOutputs | None  # the frozen blocks' recorded outputs (ppo.cache_frozen)

    @property
    def sequences(self) -> list[TrainingSequence]:
        return self.rollout.sequences


@dataclass
class IterationStats:
    """The update's figures for one iteration; ``metrics()`` names them."""

    coefs: LossCoefs
    uses_value: bool
    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # over all minibatches
    first_logratio: torch.Tensor | None = None  # first minibatch: fresh data, unchanged weights
    rollout_logratio_max: float | None = None  # recomputed old log-probs vs the rollout's
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    tokens: int = 0  # real tokens the update's forwards fed
    seconds: dict[str, float] = field(default_factory=dict)  # recompute, reference, update

    def add_step(self, minibatches: list[tuple[PPOTerms, int]], norms: tuple[float, float]) -> None:
        """A taken optimizer step: its minibatches' loss terms and the tokens their forwards fed, and
        its gradient norms (before clipping)."""
        for terms, fed in minibatches:
            for key in ("policy", "value", "entropy", "approx_kl", "clipped", "ratio", "kl_ref"):
                self.sums[key] += float(getattr(terms, key))
            self.sums["decisions"] += terms.log_ratio.numel()
            self.tokens += fed
            if self.first_logratio is None:
                self.first_logratio = terms.log_ratio.abs()
        self.sums["grad_norm"] += norms[0]
        self.sums["grad_norm_value"] += norms[1]
        self.sums["steps"] += 1

    def metrics(self) -> dict[str, float]:
        s, c = self.sums, self.coefs
        n, steps = max(s["decisions"], 1.0), max(s["steps"], 1.0)
        first = self.first_logratio if self.first_logratio is not None else torch.zeros(1)
        out = {
            "loss/policy": s["policy"] / n, "loss/entropy": s["entropy"] / n,
            "loss/total": (s["policy"] + c.vf_coef * s["value"] - c.ent_coef * s["entropy"] + c.kl_coef * s["kl_ref"]) / n,
            "policy/approx_kl": s["approx_kl"] / n, "policy/clipfrac": s["clipped"] / n,
            "policy/ratio_mean": s["ratio"] / n,
            "policy/first_logratio_max": float(first.max()), "policy/first_logratio_mean": float(first.mean()),
            "optim/grad_norm": s["grad_norm"] / steps, "optim/grad_norm_value": s["grad_norm_value"] / steps,
            "optim/skipped_steps": s["skipped_steps"],
            "perf/update_s": self.seconds["update"], "perf/update_tokens": float(self.tokens),
            "perf/tokens_per_s": self.tokens / max(self.seconds["update"], 1e-9),
        }
        if self.uses_value:
            out["loss/value"] = s["value"] / n
            out["value/explained_variance"] = explained_variance(self.old_values, self.returns)
            out["value/corr"] = correlation(self.old_values, self.returns)
        if self.rollout_logratio_max is not None:
            out["perf/recompute_s"] = self.seconds["recompute"]
            out["policy/rollout_logratio_max"] = self.rollout_logratio_max
        if c.kl_coef > 0:
            out["perf/reference_s"] = self.seconds["reference"]
            out["policy/kl_ref"] = s["kl_ref"] / n
        return out


class PPOUpdate:
    def __init__(self, policy: PolicyValueModel, ppo: PPOConfig, pad_id: int, seed: int, *,
                 reference: ReferencePolicy | None = None, frozen: FrozenPrefix | None = None,
                 runtime: Runtime | None = None):
        self.policy, self.ppo, self.pad_id, self.seed = policy, ppo, pad_id, seed
        self.reference = reference  # the KL anchor (ppo.kl_coef > 0)
        self.frozen = frozen  # frozen blocks under the trainable ones, replayed (ppo.cache_frozen)
        self.runtime = runtime or Runtime()
        self.uses_value = ppo.advantage == "gae"  # group baselines need no value head
        self.coefs = LossCoefs(ppo.clip, ppo.vf_coef if self.uses_value else 0.0, ppo.ent_coef, ppo.kl_coef,
                               ppo.explore)
        self.skipped_in_a_row = 0  # optimizer steps skipped for non-finite gradients, across iterations

    def run(self, episodes: list[Episode], iteration: int, optimizer) -> IterationStats:
        """Update the policy on one rollout's episodes with ``optimizer`` (its two parameter groups:
        the LM's trainable parameters, then the value head's)."""
        stats = IterationStats(self.coefs, self.uses_value)
        data = self.prepare(episodes, iteration, stats)  # sequences, old log-probs, reference, advantages

        start = time.perf_counter()
        for step, normalizer in zip(data.steps, self.step_normalizers(data.steps)):
            minibatches = []
            for minibatch in step:
                terms, fed = self.loss(minibatch, data, normalizer)
                self.runtime.backward(terms.loss)
                minibatches.append((terms, fed))
            norms = self.clip_gradients(optimizer)
            if self.step_is_finite(norms):
                optimizer.step()
                stats.add_step(minibatches, norms)
            else:  # a non-finite loss or gradient never reaches the weights
                stats.sums["skipped_steps"] += 1
            optimizer.zero_grad(set_to_none=True)
        self.check_weights()
        stats.seconds["update"] = time.perf_counter() - start
        return stats

    def prepare(self, episodes: list[Episode], iteration: int, stats: IterationStats | None = None) -> IterationData:
        """Everything the optimizer steps need, fixed before the first one: the sequences and their
        schedule, the old log-probs and values, the KL anchor's log-probs, the advantages."""
        p, stats = self.ppo, stats or IterationStats(self.coefs, self.uses_value)
        rollout = training_sequences(episodes)
        prefix = PrefixOutputs(self.frozen, rollout.prefix_outputs) if self.frozen is not None else None
        sequences = self.equalize_across_ranks(rollout.sequences)
        steps = optimizer_steps(sequences, p.minibatch_size, p.grad_accum, p.epochs, iteration_rng(self.seed, iteration))
        first_pass = steps[: len(steps) // p.epochs]  # every pass has the same number of steps

        # old log-probs and values: the rollout's, or under mixed precision the update's own forward's
        start = time.perf_counter()
        old_logprobs, old_values = rollout.logprobs, rollout.values
        if p.recompute_old:
            old_logprobs, old_values = self.recompute_old(first_pass, rollout, prefix)
            stats.rollout_logratio_max = float((old_logprobs - rollout.logprobs).abs().max()) if rollout.count else 0.0
        stats.seconds["recompute"] = time.perf_counter() - start
        start = time.perf_counter()
        ref_logprobs = self.reference_logprobs(first_pass, rollout, prefix) if self.reference is not None else None
        stats.seconds["reference"] = time.perf_counter() - start

        advantages, returns = rollout_advantages(episodes, old_values, p.gamma, p.lam, p.advantage,
                                                 p.normalize_advantages)
        stats.old_values, stats.returns = old_values, returns.float()
        targets = Targets(old_logprobs, old_values, advantages, returns, rollout.temperatures, ref_logprobs)
        return IterationData(rollout, steps, targets, prefix)

    def loss(self, minibatch: Minibatch, data: IterationData, normalizer: float) -> tuple[PPOTerms, int]:
        """The minibatch's PPO loss (its share of an optimizer step of ``normalizer`` decisions) and
        the real tokens its forward fed."""
        out = decision_forward(self.policy, minibatch, self.pad_id, data.prefix)
        return ppo_loss(self.batch(out, minibatch, data.targets), self.coefs, normalizer), out.fed

    # ---- the pieces run() calls ---------------------------------------------------------------
    def batch(self, out: ForkOutputs, minibatch: Minibatch, targets: Targets) -> DecisionBatch:
        """The minibatch's forward outputs beside its decisions' targets, on the forward's device."""
        idx = decision_indices(minibatch)
        device = out.logits.device

        def take(t: torch.Tensor) -> torch.Tensor:
            return t[idx].to(device=device, dtype=torch.float32)

        ref = None
        if targets.ref_logprobs is not None:
            ref = targets.ref_logprobs[idx, : out.logits.shape[1]].to(device)
        return DecisionBatch(logits=out.logits, valid=out.valid, chosen=out.chosen,
                             temperatures=take(targets.temperatures), old_logprobs=take(targets.old_logprobs),
                             advantages=take(targets.advantages), values=out.values, returns=take(targets.returns),
                             ref_logprobs=ref)

    def forward_logprobs(self, minibatch: Minibatch, temperatures: torch.Tensor,
                      prefix: PrefixOutputs | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """No-grad forward: each decision's log-probs over its fork's children at its temperature,
        the chosen entry's, and the values."""
        out = decision_forward(self.policy, minibatch, self.pad_id, prefix)
        temps = temperatures[decision_indices(minibatch)].to(out.logits.device)
        logp = fork_logprobs(out.logits, out.valid, temps[:, None], self.ppo.explore)
        return logp, logp.gather(1, out.chosen[:, None]).squeeze(1), out.values

    @torch.no_grad()
    def recompute_old(self, steps: list[OptimizerStep], rollout: RolloutDecisions,
                      prefix: PrefixOutputs | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The old log-probs and values from the update's own forward, over the first pass's
        minibatches (the same shapes the first update sees): under mixed precision the rollout's
        packed calls round differently, and the first ratio would not be 1."""
        logprobs, values = rollout.logprobs.clone(), rollout.values.clone()
        for minibatch in (mb for step in steps for mb in step):
            _, chosen, v = self.forward_logprobs(minibatch, rollout.temperatures, prefix)
            idx = decision_indices(minibatch)
            logprobs[idx], values[idx] = chosen.float().cpu(), v.float().cpu()
        return logprobs, values

    @torch.no_grad()
    def reference_logprobs(self, steps: list[OptimizerStep], rollout: RolloutDecisions,
                           prefix: PrefixOutputs | None) -> torch.Tensor:
        """Each decision's log-probs over its fork's children under the KL anchor's reference
        policy, [decisions, widest fork] with -inf at the padding; fixed for the iteration."""
        width = max((len(a) for s in rollout.sequences for a in s.allowed), default=1)
        ref = torch.full((rollout.count, width), float("-inf"))
        with self.reference.active(self.policy.lm):
            for minibatch in (mb for step in steps for mb in step):
                logp, _, _ = self.forward_logprobs(minibatch, rollout.temperatures, prefix)
                ref[decision_indices(minibatch), : logp.shape[1]] = logp.float().cpu()
        return ref

    def step_is_finite(self, norms: tuple[float, float]) -> bool:
        """Whether an optimizer step may be taken: its gradient norms (which a non-finite loss makes
        non-finite too; after DDP's all-reduce they are the same on every rank, so all ranks decide
        alike) are finite. Under fp16 loss scaling the scaler decides (it skips such steps and lowers
        its scale). Too many skipped steps in a row raise ``NonFiniteError``."""
        if self.runtime.loss_scale() is not None or all(math.isfinite(n) for n in norms):
            self.skipped_in_a_row = 0
            return True
        self.skipped_in_a_row += 1
        log.warning("optimizer step skipped: non-finite gradient norm (LM %s, value head %s)", *norms)
        if self.skipped_in_a_row >= self.ppo.max_skipped_steps:
            raise NonFiniteError(f"{self.skipped_in_a_row} optimizer steps in a row had a non-finite loss or "
                                 f"gradient (ppo.max_skipped_steps={self.ppo.max_skipped_steps}); the run stops "
                                 f"before writing a checkpoint: last.ckpt holds the last finite policy. Lower "
                                 f"ppo.lr_lm, or train in 32-true (memory=none) to rule out precision")
        return False

    def check_weights(self) -> None:
        """Non-finite weights never reach a checkpoint: checked once per iteration, before Lightning
        writes one."""
        params = [q for q in self.policy.parameters() if q.requires_grad]
        if params and not bool(torch.stack([q.isfinite().all() for q in params]).all()):
            raise NonFiniteError("a trainable weight is not finite after this iteration's update; the run "
                                 "stops before writing a checkpoint: last.ckpt holds the last finite policy")

    def step_normalizers(self, steps: list[OptimizerStep]) -> list[float]:
        """Per optimizer step, the number of decisions it holds over all ranks, divided by the world
        size (DDP averages the ranks' gradients): the step's gradient is then the mean over its decisions."""
        device = next(self.policy.parameters()).device
        counts = torch.tensor([float(sum(len(s.tokens) for mb in step for s in mb)) for step in steps], device=device)
        world = self.runtime.world_size()
        if world > 1:
            counts = self.runtime.all_reduce(counts, "sum") / world
        return [max(float(c), 1e-9) for c in counts]

    def equalize_across_ranks(self, sequences: list[TrainingSequence]) -> list[TrainingSequence]:
        """DDP needs the same number of backward passes on every rank: a rank with fewer sequences
        repeats some of its own (in order) up to the largest count."""
        if self.runtime.world_size() == 1 or not sequences:
            return sequences
        device = next(self.policy.parameters()).device
        count = self.runtime.all_reduce(torch.tensor(len(sequences), device=device), "max")
        return [sequences[i % len(sequences)] for i in range(int(count))]

    def clip_gradients(self, optimizer) -> tuple[float, float]:
        """Clip the LM's and the value head's gradient norms separately, each at ``max_grad_norm``:
        clipped together, the larger one (usually the LM's) would scale the other down, and
        ``vf_coef`` would act only through the clip. Returns both norms before clipping."""
        # fp16: gradients are still multiplied by the loss scale here (the precision plugin
        # unscales inside step()); clipping the scaled norm at max_norm * scale is the same clip
        scale = self.runtime.loss_scale() or 1.0
        max_norm = self.ppo.max_grad_norm * scale
        lm, value = (group["params"] for group in optimizer.param_groups)
        return (float(torch.nn.utils.clip_grad_norm_(lm, max_norm)) / scale,
                float(torch.nn.utils.clip_grad_norm_(value, max_norm)) / scale)
