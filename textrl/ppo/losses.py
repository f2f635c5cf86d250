"""The PPO loss, as pure functions of per-decision tensors.

A decision is one sampled token at a fork of the command trie. ``DecisionBatch`` holds a
minibatch's decisions flat: ``logits`` [decisions, width] are the model's next-token logits of each
fork's allowed tokens (``textrl.ppo.sequences.decision_forward``), ``valid`` marks the real entries
of each row and ``chosen`` the entry taken. Logits over the whole vocabulary with ``valid`` the
fork's children are the same computation (width = vocabulary), only slower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from textrl.policy.distribution import entropy, fork_logprobs, kl_to_reference


@dataclass
class DecisionBatch:
    """A minibatch's decisions: the update's forward (``logits``, ``values``) beside what the
    rollout and the advantage estimator fixed for the iteration."""

    logits: torch.Tensor  # [decisions, width] the fork's allowed tokens' logits
    valid: torch.Tensor  # [decisions, width] bool: real entries
    chosen: torch.Tensor  # [decisions] long: the entry taken
    temperatures: torch.Tensor  # [decisions] the temperature it was sampled at
    old_logprobs: torch.Tensor  # [decisions] log-prob of the chosen entry under the rollout's policy
    advantages: torch.Tensor  # [decisions]
    values: torch.Tensor  # [decisions] the value head's estimate (update's forward)
    returns: torch.Tensor  # [decisions] value targets
    ref_logprobs: torch.Tensor | None = None  # [decisions, width] the KL anchor's, -inf at the padding


@dataclass(frozen=True)
class LossCoefs:
    """The loss's settings (their defaults: ``PPOConfig``)."""

    clip: float  # ratio clip range
    vf_coef: float  # value loss weight (0: no value head)
    ent_coef: float  # entropy bonus weight
    kl_coef: float  # weight of the exact KL to the reference policy
    explore: float  # the policy mixes each fork with this share of uniform, as in the rollout


@dataclass
class PPOTerms:
    """``loss`` is what to backpropagate; the rest are sums over the minibatch's decisions (divide
    by the decision count for means), detached, for logging."""

    loss: torch.Tensor  # (sum of per-decision losses) / normalizer
    policy: torch.Tensor  # clipped surrogate, summed
    value: torch.Tensor  # 0.5 (V - R)^2, summed
    entropy: torch.Tensor  # entropy over the allowed tokens, summed
    approx_kl: torch.Tensor  # k3 estimator of KL(old || new), (r - 1) - log r, summed
    clipped: torch.Tensor  # number of decisions whose ratio left [1 - clip, 1 + clip]
    ratio: torch.Tensor  # sum of the ratios
    log_ratio: torch.Tensor  # per decision (detached): rollout/update agreement on fresh data
    kl_ref: torch.Tensor  # exact KL(policy || reference) over the allowed tokens, summed (0 without one)

    @classmethod
    def none(cls, loss: torch.Tensor) -> "PPOTerms":
        """The terms of a minibatch with no decisions (a DDP rank with no sequences), with ``loss``."""
        zero = torch.zeros((), device=loss.device)
        return cls(loss, zero, zero, zero, zero, zero, zero, torch.zeros(0, device=loss.device), zero)


def ppo_loss(mb: DecisionBatch, coefs: LossCoefs, normalizer: float) -> PPOTerms:
    """Clipped PPO loss of a minibatch's decisions, summed and divided by ``normalizer``.

    ``normalizer`` is the number of decisions in the whole optimizer step this minibatch belongs
    to: the gradients of its minibatches then add up to the gradient of the mean over all of the
    step's decisions, however the step is split (each decision weighs the same, whether it comes
    from a one-turn win or a thirty-turn failure). With ``mb.ref_logprobs``, ``kl_coef`` x the exact
    KL to the reference is added at each decision (``kl_to_reference``).
    """
    newlogprobs_all = fork_logprobs(mb.logits, mb.valid, mb.temperatures[:, None], coefs.explore)
    newlogprob = newlogprobs_all.gather(1, mb.chosen[:, None]).squeeze(1)
    logratio = newlogprob - mb.old_logprobs
    ratio = logratio.exp()

    pg_loss1 = -mb.advantages * ratio
    pg_loss2 = -mb.advantages * torch.clamp(ratio, 1 - coefs.clip, 1 + coefs.clip)
    pg_loss = torch.max(pg_loss1, pg_loss2).sum()
    v_loss = 0.5 * (mb.values - mb.returns).pow(2).sum()
    entropy_sum = entropy(newlogprobs_all).sum()
    kl_ref = (kl_to_reference(newlogprobs_all, mb.ref_logprobs).sum() if mb.ref_logprobs is not None
              else torch.zeros((), device=mb.logits.device))
    loss = (pg_loss + coefs.vf_coef * v_loss - coefs.ent_coef * entropy_sum + coefs.kl_coef * kl_ref) / normalizer

    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).sum()
        clipped = ((ratio - 1).abs() > coefs.clip).sum().float()
    return PPOTerms(loss, pg_loss.detach(), v_loss.detach(), entropy_sum.detach(), approx_kl, clipped,
                    ratio.detach().sum(), logratio.detach(), kl_ref.detach())


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns): 1 is perfect, 0 is a constant, < 0 is harmful."""
    if returns.numel() < 2:  # no variance to explain (a DDP rank with no decisions)
        return float("nan")
    var = returns.var()
    return float("nan") if var == 0 else float(1 - (returns - values).var() / var)


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() < 2 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])
