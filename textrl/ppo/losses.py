"""The PPO loss, as pure functions of per-decision tensors.

All inputs are flat over the decision tokens of a minibatch. ``logits`` [decisions, width] are the
model's next-token logits of each fork's allowed tokens (``textrl.ppo.buffer.Decisions``), ``valid``
marks the real entries of each row and ``chosen`` the entry taken. Logits over the whole vocabulary
with ``valid`` the fork's children are the same computation (width = vocabulary), only slower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from textrl.policy.decoding import masked_logprobs


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


def entropy_over_allowed(logprobs: torch.Tensor) -> torch.Tensor:
    """Entropy of each masked distribution (disallowed entries are -inf and contribute 0)."""
    probs = logprobs.exp()
    return -(probs * logprobs.masked_fill(probs == 0, 0.0)).sum(-1)


def kl_over_allowed(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Exact KL(p || ref) of each decision over its fork's allowed tokens (a few logits, no estimator).

    ``logp`` [decisions, width]: the policy's log-probs of the allowed tokens (-inf at the padding);
    ``ref_logp`` [decisions, width]: the reference's log-probs of the same tokens, -inf at the padding.
    """
    valid = torch.isfinite(ref_logp)
    # zeros at the padding before any arithmetic: exp(-inf) x -inf there would be a NaN gradient
    logp = logp.masked_fill(~valid, 0.0)
    terms = logp.exp() * (logp - ref_logp.masked_fill(~valid, 0.0))
    return terms.masked_fill(~valid, 0.0).sum(-1)


def ppo_loss(logits: torch.Tensor, valid: torch.Tensor, chosen: torch.Tensor, temperatures: torch.Tensor,
             old_logprobs: torch.Tensor, advantages: torch.Tensor, values: torch.Tensor, returns: torch.Tensor,
             clip: float, vf_coef: float, ent_coef: float, normalizer: float, kl_coef: float = 0.0,
             reference: torch.Tensor | None = None, explore: float = 0.0) -> PPOTerms:
    """Clipped PPO loss of a minibatch's decisions, summed and divided by ``normalizer``.

    ``normalizer`` is the number of decisions in the whole optimizer step this minibatch belongs
    to: the gradients of its minibatches then add up to the gradient of the mean over all of the
    step's decisions, however the step is split (each decision weighs the same, whether it comes
    from a one-turn win or a thirty-turn failure). ``reference`` (the reference policy's log-probs
    of the same entries, -inf at the padding) adds ``kl_coef`` x the exact KL to it at each
    decision (``kl_over_allowed``).
    ``explore``: the policy is the fork's softmax mixed with uniform, as in the rollout (``mix_uniform``).
    """
    logp_all = masked_logprobs(logits / temperatures[:, None], valid, 1.0, explore)
    logp = logp_all.gather(1, chosen[:, None]).squeeze(1)
    log_ratio = logp - old_logprobs
    ratio = log_ratio.exp()
    policy = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip)).sum()
    value = 0.5 * (values - returns).pow(2).sum()
    entropy = entropy_over_allowed(logp_all).sum()
    kl = kl_over_allowed(logp_all, reference).sum() if reference is not None else torch.zeros((), device=logits.device)
    loss = (policy + vf_coef * value - ent_coef * entropy + kl_coef * kl) / normalizer
    with torch.no_grad():
        approx_kl = ((ratio - 1) - log_ratio).sum()
        clipped = ((ratio - 1).abs() > clip).sum().float()
    return PPOTerms(loss, policy.detach(), value.detach(), entropy.detach(), approx_kl, clipped,
                    ratio.detach().sum(), log_ratio.detach(), kl.detach())


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns): 1 is perfect, 0 is a constant, < 0 is harmful."""
    var = returns.var()
    return float("nan") if var == 0 else float(1 - (returns - values).var() / var)


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() < 2 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])
