"""One PPO update, top to bottom: what happens to a rollout's episodes.

``PPOUpdate.run`` reads as the algorithm: episodes -> training sequences -> old log-probs and values
(recomputed with the update's own forward under mixed precision) -> the KL anchor's log-probs ->
advantages -> ``ppo.epochs`` shuffled passes of optimizer steps, each the mean loss over its
decisions, gradients clipped -> statistics (``IterationStats``, which knows its metric names).

It is a plain object: the LightningModule hands it Lightning's backward and cross-rank reduction
(``Runtime``); a test or a script can run it with the defaults, one process and plain backward.
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Callable

import torch

from textrl.config import PPOConfig
from textrl.errors import NonFiniteError
from textrl.policy.device import PhaseTimer
from textrl.policy.distribution import fork_logprobs
from textrl.policy.speed import FrozenPrefix
from textrl.policy.model import PolicyValueModel
from textrl.policy.reference import ReferencePolicy
from textrl.ppo.advantages import rollout_advantages
from textrl.ppo.skipped_steps import SkippedSteps
from textrl.ppo.losses import DecisionBatch, LossCoefs, PPOTerms, correlation, explained_variance, ppo_loss
from textrl.ppo.sequences import (ForkOutputs, PrefixOutputs, RolloutDecisions, TrainingSequence, decision_forward,
                                  optimizer_steps, release_prefix_outputs, training_sequences)
from textrl.rollout import Episode, iteration_rng

log = logging.getLogger(__name__)

# a rank with fewer sequences than another still runs the steps every rank runs (DDP): its
# minibatches hold None in their place, whose loss is a zero that reaches every trainable weight
# (``PPOUpdate.loss``)
Minibatch = list[TrainingSequence | None]
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
    # inside, a backward accumulates without the ranks' gradient all-reduce (DDP's no_sync): every
    # backward of an optimizer step but its last
    no_sync: Callable[[], AbstractContextManager] = contextlib.nullcontext


@dataclass
class Targets:
    """What one iteration's loss compares against, fixed before the first optimizer step: flat over
    the rollout's decisions (``TrainingSequence.decisions`` indexes them), float32 on the policy's
    device (copied there once per iteration, never per minibatch)."""

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
    coefs: LossCoefs  # the loss's settings, with the exploration the rollout sampled with

    @property
    def sequences(self) -> list[TrainingSequence]:
        return self.rollout.sequences


TERMS = ("policy", "value", "entropy", "approx_kl", "clipped", "ratio", "kl_ref")  # PPOTerms summed over decisions


@dataclass
class IterationStats:
    """The update's figures for one iteration; ``metrics()`` names them. Sums stay on the device
    while the update runs and are read once, by ``metrics()``."""

    coefs: LossCoefs
    uses_value: bool
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # TERMS over all minibatches, grad_norm[_value]
    decisions: int = 0  # decisions of the taken steps
    steps: int = 0  # optimizer steps taken
    skipped_steps: int = 0  # skipped for a non-finite gradient
    planned_steps: int = 0  # with ppo.target_kl: the iteration's optimizer steps before any early stop
    first_logratio: torch.Tensor | None = None  # first minibatch: fresh data, unchanged weights
    rollout_logratio_max: torch.Tensor | None = None  # recomputed old log-probs vs the rollout's
    old_values: torch.Tensor | None = None  # host copies, for the value figures
    returns: torch.Tensor | None = None
    tokens: int = 0  # real tokens the update's forwards fed
    timer: PhaseTimer | None = None  # recompute, reference, update

    def __post_init__(self):
        self.sums = {k: torch.zeros((), device=self.device) for k in (*TERMS, "grad_norm", "grad_norm_value")}
        self.timer = self.timer or PhaseTimer(self.device)

    def add_step(self, minibatches: list[tuple[PPOTerms, int]], norms: torch.Tensor) -> None:
        """A taken optimizer step: its minibatches' loss terms and the tokens their forwards fed, and
        its gradient norms (before clipping, [LM, value head] on the device)."""
        for terms, fed in minibatches:
            for key in TERMS:
                self.sums[key] = self.sums[key] + getattr(terms, key)
            self.decisions += terms.log_ratio.numel()
            self.tokens += fed
            if self.first_logratio is None and terms.log_ratio.numel():
                self.first_logratio = terms.log_ratio.abs()
        self.sums["grad_norm"] = self.sums["grad_norm"] + norms[0]
        self.sums["grad_norm_value"] = self.sums["grad_norm_value"] + norms[1]
        self.steps += 1

    def metrics(self) -> dict[str, float]:
        first = self.first_logratio if self.first_logratio is not None else torch.zeros(1, device=self.device)
        extra = {"first_max": first.max(), "first_mean": first.mean()}
        if self.rollout_logratio_max is not None:
            extra["rollout_logratio_max"] = self.rollout_logratio_max
        names = [*self.sums, *extra]
        s = dict(zip(names, torch.stack([*self.sums.values(), *extra.values()]).float().tolist()))  # one read
        c, n, steps = self.coefs, max(self.decisions, 1), max(self.steps, 1)
        update_s = self.timer.seconds("update")
        out = {
            "loss/policy": s["policy"] / n, "loss/entropy": s["entropy"] / n,
            "loss/total": (s["policy"] + c.vf_coef * s["value"] - c.ent_coef * s["entropy"] + c.kl_coef * s["kl_ref"]) / n,
            "policy/approx_kl": s["approx_kl"] / n, "policy/clipfrac": s["clipped"] / n,
            "policy/ratio_mean": s["ratio"] / n,
            "policy/first_logratio_max": s["first_max"], "policy/first_logratio_mean": s["first_mean"],
            "optim/grad_norm": s["grad_norm"] / steps, "optim/grad_norm_value": s["grad_norm_value"] / steps,
            "optim/skipped_steps": float(self.skipped_steps),
            "perf/update_s": update_s, "perf/update_tokens": float(self.tokens),
            "perf/tokens_per_s": self.tokens / max(update_s, 1e-9),
        }
        if self.planned_steps:
            out["optim/steps_share"] = (self.steps + self.skipped_steps) / self.planned_steps
        if self.uses_value:
            out["loss/value"] = s["value"] / n
            out["value/explained_variance"] = explained_variance(self.old_values, self.returns)
            out["value/corr"] = correlation(self.old_values, self.returns)
        if self.rollout_logratio_max is not None:
            out["perf/recompute_s"] = self.timer.seconds("recompute")
            out["policy/rollout_logratio_max"] = s["rollout_logratio_max"]
        if c.kl_coef > 0:
            out["perf/reference_s"] = self.timer.seconds("reference")
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
        self.skips = SkippedSteps(ppo.max_skipped_steps, "PPO update", "the run stops before writing a checkpoint: "
                                  "last.ckpt holds the last finite policy. Lower ppo.lr_lm, or train in 32-true "
                                  "(memory=none) to rule out precision")

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    def run(self, episodes: list[Episode], iteration: int, optimizer) -> IterationStats:
        """Update the policy on one rollout's episodes with ``optimizer`` (its two parameter groups:
        the LM's trainable parameters, then the value head's)."""
        stats = IterationStats(self.coefs, self.uses_value, self.device)
        data = self.prepare(episodes, iteration, stats)  # sequences, old log-probs, reference, advantages
        kl_stop = self.ppo.target_kl is not None
        if kl_stop:
            stats.planned_steps = len(data.steps)

        with stats.timer.phase("update"):
            for step, normalizer in zip(data.steps, self.step_normalizers(data.steps)):
                minibatches = []
                with self.policy.weights_cast_once():  # the step's forwards share one cast of each weight
                    for k, minibatch in enumerate(step):
                        # gradients accumulate locally; DDP all-reduces them once, at the step's last backward
                        with self.runtime.no_sync() if k < len(step) - 1 else contextlib.nullcontext():
                            terms, fed = self.loss(minibatch, data, normalizer)
                            self.runtime.backward(terms.loss)
                        minibatches.append((terms, fed))
                norms = self.clip_gradients(optimizer)
                # the step's loss, summed over the ranks: a rank's non-finite loss stops every rank alike
                loss = self.runtime.all_reduce(torch.stack([t.loss.detach().float() for t, _ in minibatches]).sum(), "sum")
                # the step's one read on the host: its gradient norms and loss, and with ppo.target_kl its KL
                host = torch.cat([norms, loss[None], *([self.step_kl(minibatches)] if kl_stop else [])]).tolist()
                if kl_stop and host[3] > self.ppo.target_kl * host[4]:  # mean approx_kl past the target
                    # this step's forwards saw a policy already past the target: neither it nor any
                    # later step is taken (every rank read the same reduced sums, so all stop here)
                    optimizer.zero_grad(set_to_none=True)
                    break
                step_it, taken = self.skips.decide(host[2], host[:2], self.runtime.loss_scale() is not None)
                if step_it:  # a non-finite loss or gradient never reaches the weights (under fp16: the scaler's skip)
                    optimizer.step()
                if taken:
                    stats.add_step(minibatches, norms)
                else:
                    stats.skipped_steps += 1
                optimizer.zero_grad(set_to_none=True)
            self.check_weights()
        return stats

    def prepare(self, episodes: list[Episode], iteration: int, stats: IterationStats | None = None) -> IterationData:
        """Everything the optimizer steps need, fixed before the first one: the sequences and their
        schedule, the old log-probs and values, the KL anchor's log-probs, the advantages. The
        episodes' recordings of the frozen blocks' outputs are released once the sequences hold
        theirs (``release_prefix_outputs``)."""
        p, stats = self.ppo, stats or IterationStats(self.coefs, self.uses_value, self.device)
        rollout = training_sequences(episodes)
        release_prefix_outputs(episodes)  # the iteration holds the sequences' copies only
        prefix = PrefixOutputs(self.frozen, rollout.prefix_outputs) if self.frozen is not None else None
        sequences = self.equalize_across_ranks(rollout.sequences)
        steps = optimizer_steps(sequences, p.minibatch_size, p.grad_accum, p.epochs, iteration_rng(self.seed, iteration))
        first_pass = [[real for mb in step if (real := [s for s in mb if s is not None])]
                      for step in steps[: len(steps) // p.epochs]]
        coefs = self.coefs  # explore: the mixture the rollout sampled

        # what the rollout recorded, on the device in one copy
        sampled, old_values, temperatures = torch.stack([rollout.logprobs, rollout.values, rollout.temperatures]).to(self.device)
        # old log-probs and values: the rollout's, or under mixed precision the update's own forward's
        old_logprobs = sampled
        if p.recompute_old:
            with stats.timer.phase("recompute"):
                old_logprobs, old_values = self.recompute_old(first_pass, sampled, old_values, temperatures, prefix,
                                                            coefs.explore)
            stats.rollout_logratio_max = (old_logprobs - sampled).abs().max() if rollout.count else sampled.new_zeros(())
        ref_logprobs = None
        if self.reference is not None:
            with stats.timer.phase("reference"):
                ref_logprobs = self.reference_logprobs(first_pass, rollout, temperatures, prefix, coefs.explore)

        # GAE runs over the episodes' turns on the host: the old values' one read per iteration
        host_values = old_values.cpu()
        advantages, returns = rollout_advantages(episodes, host_values, p.gamma, p.lam, estimator=p.advantage,
                                                 normalize=p.normalize_advantages, step_weight=p.step_weight)
        stats.old_values, stats.returns = host_values, returns.float()
        advantages, returns = torch.stack([advantages, returns]).float().to(self.device)
        targets = Targets(old_logprobs, old_values, advantages, returns, temperatures, ref_logprobs)
        return IterationData(rollout, steps, targets, prefix, coefs)

    def loss(self, minibatch: Minibatch, data: IterationData, normalizer: float) -> tuple[PPOTerms, int]:
        """The minibatch's PPO loss (its share of an optimizer step of ``normalizer`` decisions) and
        the real tokens its forward fed. A rank with no sequences (``Minibatch``) gets a zero loss over
        every trainable weight: its backward joins the ranks' gradient all-reduce with zeros."""
        minibatch = [s for s in minibatch if s is not None]
        if not minibatch:
            return PPOTerms.none(self.zero_loss()), 0
        out = decision_forward(self.policy, minibatch, self.pad_id, data.prefix)
        return ppo_loss(self.batch(out, data.targets), data.coefs, normalizer), out.fed

    def zero_loss(self) -> torch.Tensor:
        """A zero whose backward reaches every trainable weight (DDP reduces every one)."""
        return sum(q.sum() for q in self.policy.parameters() if q.requires_grad) * 0.0

    # ---- the pieces run() calls ---------------------------------------------------------------
    def batch(self, out: ForkOutputs, targets: Targets) -> DecisionBatch:
        """The minibatch's forward outputs beside its decisions' targets, all on the forward's
        device (``out.decisions`` indexes the iteration's targets there)."""
        idx = out.decisions
        ref = targets.ref_logprobs[idx, : out.logits.shape[1]] if targets.ref_logprobs is not None else None
        return DecisionBatch(logits=out.logits, valid=out.valid, chosen=out.chosen,
                             temperatures=targets.temperatures[idx], old_logprobs=targets.old_logprobs[idx],
                             advantages=targets.advantages[idx], values=out.values, returns=targets.returns[idx],
                             ref_logprobs=ref)

    def forward_logprobs(self, minibatch: Minibatch, temperatures: torch.Tensor, prefix: PrefixOutputs | None,
                         explore: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """No-grad forward: each decision's log-probs over its fork's children at its temperature,
        mixed with ``explore`` x uniform, the chosen entry's, the values, and where the decisions sit
        in the iteration's tensors."""
        out = decision_forward(self.policy, minibatch, self.pad_id, prefix)
        logp = fork_logprobs(out.logits, out.valid, temperatures[out.decisions][:, None], explore)
        return logp, logp.gather(1, out.chosen[:, None]).squeeze(1), out.values, out.decisions

    @torch.no_grad()
    def recompute_old(self, steps: list[OptimizerStep], logprobs: torch.Tensor, values: torch.Tensor,
                      temperatures: torch.Tensor, prefix: PrefixOutputs | None, explore: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The old log-probs and values from the update's own forward, over the first pass's
        minibatches (the same shapes the first update sees): under mixed precision the rollout's
        packed calls round differently, and the first ratio would not be 1."""
        logprobs, values = logprobs.clone(), values.clone()
        with self.policy.weights_cast_once():
            for minibatch in (mb for step in steps for mb in step):
                _, chosen, v, idx = self.forward_logprobs(minibatch, temperatures, prefix, explore)
                logprobs[idx], values[idx] = chosen.float(), v.float()
        return logprobs, values

    @torch.no_grad()
    def reference_logprobs(self, steps: list[OptimizerStep], rollout: RolloutDecisions, temperatures: torch.Tensor,
                           prefix: PrefixOutputs | None, explore: float) -> torch.Tensor:
        """Each decision's log-probs over its fork's children under the KL anchor's reference
        policy, [decisions, widest fork] with -inf at the padding; fixed for the iteration."""
        width = max((len(a) for s in rollout.sequences for a in s.allowed), default=1)
        ref = torch.full((rollout.count, width), float("-inf"), device=self.device)
        with self.reference.active(self.policy.lm), self.policy.weights_cast_once():
            for minibatch in (mb for step in steps for mb in step):
                logp, _, _, idx = self.forward_logprobs(minibatch, temperatures, prefix, explore)
                ref[idx, : logp.shape[1]] = logp.float()
        return ref

    def step_kl(self, minibatches: list[tuple[PPOTerms, int]]) -> torch.Tensor:
        """[approx_kl summed over an optimizer step's decisions, their number], summed over the ranks
        (so that every rank takes the same early-stop decision), on the device."""
        kl = torch.stack([terms.approx_kl for terms, _ in minibatches]).sum()
        decisions = torch.full((), float(sum(terms.log_ratio.numel() for terms, _ in minibatches)), device=kl.device)
        return self.runtime.all_reduce(torch.stack([kl.float(), decisions]), "sum")

    def check_weights(self) -> None:
        """Non-finite weights never reach a checkpoint: checked once per iteration, before Lightning
        writes one."""
        params = [q for q in self.policy.parameters() if q.requires_grad]
        if params and not bool(torch.stack([q.isfinite().all() for q in params]).all()):
            raise NonFiniteError("a trainable weight is not finite after this iteration's update; the run "
                                 "stops before writing a checkpoint: last.ckpt holds the last finite policy")

    def step_normalizers(self, steps: list[OptimizerStep]) -> list[float]:
        """Per optimizer step, the number of decisions it holds over all ranks, divided by the world
        size (DDP averages the ranks' gradients): the step's gradient is then the mean over its decisions.
        Every rank has the same steps (``equalize_across_ranks``), so the reduced tensors match."""
        counts = [float(sum(len(s.tokens) for mb in step for s in mb if s is not None)) for step in steps]
        world = self.runtime.world_size()
        if world > 1:  # one reduction and one read per iteration
            counts = (self.runtime.all_reduce(torch.tensor(counts, device=self.device), "sum") / world).tolist()
        return [max(c, 1e-9) for c in counts]

    def equalize_across_ranks(self, sequences: list[TrainingSequence]) -> Minibatch:
        """DDP needs the same number of backward passes on every rank: a rank with fewer sequences
        is filled up to the largest count with None, whose loss is a zero over every trainable weight
        (``loss``). Every rank joins the reduction, whatever its share, and each sequence weighs once:
        the gradient is the one a single process computes over all ranks' sequences."""
        if self.runtime.world_size() == 1:
            return sequences
        count = int(self.runtime.all_reduce(torch.tensor(len(sequences), device=self.device), "max"))
        return [*sequences, *[None] * (count - len(sequences))]

    def clip_gradients(self, optimizer) -> torch.Tensor:
        """Clip the LM's and the value head's gradient norms separately, each at ``max_grad_norm``:
        clipped together, the larger one (usually the LM's) would scale the other down, and
        ``vf_coef`` would act only through the clip. Returns both norms before clipping, [LM, value
        head], on the device (read once per step, by ``run``)."""
        # fp16: gradients are still multiplied by the loss scale here (the precision plugin
        # unscales inside step()); clipping the scaled norm at max_norm * scale is the same clip
        scale = self.runtime.loss_scale() or 1.0
        max_norm = self.ppo.max_grad_norm * scale
        norms = []
        for group in optimizer.param_groups:  # the LM's, then the value head's
            params = [q for q in group["params"] if q.grad is not None]
            # no gradient (the value head under group baselines): norm 0, made on the device
            norms.append(torch.nn.utils.clip_grad_norm_(params, max_norm) if params
                         else torch.zeros((), device=self.device))
        return torch.stack(norms).float() / scale
