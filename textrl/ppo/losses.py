"""The PPO loss, as pure functions of per-decision tensors.

All inputs are flat over the decision tokens of a minibatch. ``logits`` are the model's next-token
logits at each decision position, ``allowed`` the fork's children (bool over the vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from textrl.policy.decoding import masked_logprobs


@dataclass
class PPOTerms:
    total: torch.Tensor
    policy: torch.Tensor
    value: torch.Tensor
    entropy: torch.Tensor
    approx_kl: torch.Tensor  # k3 estimator of KL(old || new): mean((r - 1) - log r)
    clipfrac: torch.Tensor  # fraction of decisions whose ratio left [1 - clip, 1 + clip]
    ratio_mean: torch.Tensor


def entropy_over_allowed(logprobs: torch.Tensor) -> torch.Tensor:
    """Entropy of each masked distribution (disallowed entries are -inf and contribute 0)."""
    probs = logprobs.exp()
    return -(probs * logprobs.masked_fill(probs == 0, 0.0)).sum(-1)


def ppo_loss(logits: torch.Tensor, allowed: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor,
             old_logprobs: torch.Tensor, advantages: torch.Tensor, values: torch.Tensor, returns: torch.Tensor,
             clip: float, vf_coef: float, ent_coef: float) -> PPOTerms:
    logp_all = masked_logprobs(logits / temperatures[:, None], allowed, 1.0)
    logp = logp_all.gather(1, tokens[:, None]).squeeze(1)
    log_ratio = logp - old_logprobs
    ratio = log_ratio.exp()
    policy = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip)).mean()
    value = 0.5 * (values - returns).pow(2).mean()
    entropy = entropy_over_allowed(logp_all).mean()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - log_ratio).mean()
        clipfrac = ((ratio - 1).abs() > clip).float().mean()
    return PPOTerms(policy + vf_coef * value - ent_coef * entropy, policy, value, entropy, approx_kl, clipfrac,
                    ratio.detach().mean())


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns): 1 is perfect, 0 is a constant, < 0 is harmful."""
    var = returns.var()
    return float("nan") if var == 0 else float(1 - (returns - values).var() / var)


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() < 2 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])
