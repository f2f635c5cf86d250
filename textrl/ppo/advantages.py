"""Advantage estimators: GAE per turn (with the value head), and the critic-free group baselines
over the episodes of one game: GRPO, RLOO, and GiGPO's step-level groups (turns of those episodes
that start from the same state).

GAE, the rule, and why:

* **Discounting is per turn.** gamma and lambda apply between turns (environment steps), never
  between the tokens of one command: ``unlock chest with key`` (several forks) and ``drop key``
  (one fork) are one step of the game each, and are discounted alike. Within a turn there is no
  reward and no discount.
* **A turn's decisions share the turn's outcome.** Turn j has the value V_j read at its first
  decision (the state the command is chosen in), the reward r_j, and the discount d_j to the next
  turn that has a decision. Plain GAE over the turns gives the turn's advantage A_j and its
  return R_j = A_j + V_j. Every decision k of the turn gets the return R_j as its value target,
  and the advantage R_j - V_{j,k} against its own value estimate: the first decision gets exactly
  A_j, later ones are baselined by a state that already includes the command's first tokens.
* **Turns without a decision** (one admissible command, auto-advanced) are part of the previous
  turn's transition: their reward is added to it discounted (r_j + d_j r), and the discount to the
  next decision grows by one step (d_j gamma). Before the first decision there is no action to
  credit, and such rewards are dropped.
* **Truncation is not termination.** An episode that ends because it won or lost has no future
  (value 0 after it). An episode cut by the step limit continues from the state it was cut in:
  its last turn bootstraps from the value of that state (read the same way, at its first fork,
  by ``ConstrainedDecoder.values``). The prompt does not show the steps left, so treating the cut
  as the end would teach the value head that the same-looking state has no future at step 8 and a
  future at step 3.
"""

from __future__ import annotations

import torch

from textrl.rollout import Episode, Step


def gae(rewards: torch.Tensor, values: torch.Tensor, discounts: torch.Tensor, lam: float,
        last_value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the turns of one episode.

    ``discounts[j]`` is the discount from turn j to the next (gamma, or a power of it across turns
    without a decision); ``last_value`` the value of the state after the last turn (0 when the
    episode ended, the bootstrap value when it was truncated). Returns (advantages, returns).
    """
    advantages = torch.zeros_like(values)
    next_value = torch.tensor(last_value, dtype=values.dtype)
    running = torch.zeros((), dtype=values.dtype)
    for j in range(len(rewards) - 1, -1, -1):
        delta = rewards[j] + discounts[j] * next_value - values[j]
        running = delta + discounts[j] * lam * running
        advantages[j] = running
        next_value = values[j]
    return advantages, advantages + values


def grpo(returns: torch.Tensor, groups: list, eps: float = 1e-8) -> torch.Tensor:
    """Group-normalised returns: (R - mean of its group) / (std of its group + eps).

    ``returns[i]`` is episode i's return, ``groups[i]`` its group (the game it played); a group's
    episodes are the same game sampled several times, so its mean is a baseline no value head has to
    learn. A group whose episodes all scored the same gets 0 (nothing to prefer).
    """
    advantages = torch.zeros_like(returns)
    for members in _members(groups).values():
        r = returns[members]
        std = r.std() if len(members) > 1 else torch.zeros((), dtype=r.dtype)
        advantages[members] = (r - r.mean()) / (std + eps)
    return advantages


def rloo(returns: torch.Tensor, groups: list) -> torch.Tensor:
    """Leave-one-out baseline: R minus the mean return of the *other* episodes of its group
    (unbiased: an episode's baseline does not depend on its own sample)."""
    advantages = torch.zeros_like(returns)
    for members in _members(groups).values():
        r = returns[members]
        k = len(members)
        advantages[members] = (r - (r.sum() - r) / (k - 1)) if k > 1 else torch.zeros_like(r)
    return advantages


def gigpo(returns: torch.Tensor, groups: list, step_returns: torch.Tensor, step_groups: list,
          step_episode: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
    """GiGPO (Feng et al., 2025, "Group-in-Group Policy Optimization"): a turn's advantage is its
    episode's group-relative return plus ``weight`` x its own relative return within its step group.

    ``returns[i]`` / ``groups[i]``: episode i's return and game (as in ``grpo``); ``step_returns[t]``:
    the discounted return from turn t on, ``step_groups[t]``: the state turn t starts from (with its
    game), ``step_episode[t]``: its episode. Turns of one game's episodes that start from the same
    state are alternatives from one state: comparing their returns credits the command, not the luck
    of the rest of the episode. A turn whose state no other turn shares gets its episode's advantage
    alone, so with no repeated state this is GRPO. As in the paper, a state one episode comes back to
    is in its step group once per visit: the later visit, with fewer steps (and step penalties) left,
    has the higher return, which credits the command that left a loop over the one that closed it.
    Truncated episodes are not bootstrapped (no value head).
    """
    return grpo(returns, groups)[step_episode] + weight * grpo(step_returns, step_groups)


def state_key(episode: Episode, step: Step) -> tuple:
    """The state a turn starts from, as GiGPO's anchor: the game, and what the game shows of it
    (room description and inventory); not the feedback, which tells how the state was reached."""
    return episode.game, *step.observation.state


def _members(groups: list) -> dict:
    members: dict = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    return members


def whiten(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero mean, unit variance (advantage normalisation)."""
    if x.numel() < 2:
        return x - x.mean()
    return (x - x.mean()) / (x.std() + eps)


def episode_gae(episode: Episode, values: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of an episode's decisions, in order, under the rule above; ``values``
    are the decisions' value estimates in the same order. float64."""
    rewards, discounts, first, counts = [], [], [], []
    k = 0
    for step in episode.steps:
        n = len(step.action.decisions)
        if n:
            rewards.append(step.reward)
            discounts.append(gamma)
            first.append(float(values[k]))
            counts.append(n)
            k += n
        elif rewards:  # a turn without a decision: part of the previous turn's transition
            rewards[-1] += discounts[-1] * step.reward
            discounts[-1] *= gamma
    if k != len(values):
        raise ValueError(f"{len(values)} values for the {k} decisions of {episode.game}")
    f64 = torch.float64
    if not rewards:
        return torch.zeros(0, dtype=f64), torch.zeros(0, dtype=f64)
    if episode.truncated and episode.bootstrap_value is None:
        raise ValueError(f"the episode of {episode.game} was truncated but has no bootstrap value: "
                         f"play training rollouts with bootstrap=True")
    last = episode.bootstrap_value if episode.truncated else 0.0
    _, turn_returns = gae(torch.tensor(rewards, dtype=f64), torch.tensor(first, dtype=f64),
                          torch.tensor(discounts, dtype=f64), lam, last)
    returns = torch.repeat_interleave(turn_returns, torch.tensor(counts))
    return returns - values.to(f64), returns


def _gigpo_decisions(episodes: list[Episode], gamma: float, weight: float) -> torch.Tensor:
    """``gigpo``'s turn advantages, one per decision, in rollout order. Turns without a decision
    (auto-advanced) are no choice: they get no advantage, and their rewards count in the return of
    the turns before them."""
    step_returns, step_groups, step_episode, counts = [], [], [], []
    for i, e in enumerate(episodes):
        to_go, later = 0.0, []
        for s in reversed(e.steps):  # discounted return from each turn on
            to_go = s.reward + gamma * to_go
            later.append(to_go)
        for s, g in zip(e.steps, reversed(later)):
            if s.action.decisions:
                step_returns.append(g)
                step_groups.append(state_key(e, s))
                step_episode.append(i)
                counts.append(len(s.action.decisions))
    f64 = torch.float64
    totals = torch.tensor([e.total_return for e in episodes], dtype=f64)
    per_turn = gigpo(totals, [e.game for e in episodes], torch.tensor(step_returns, dtype=f64), step_groups,
                     torch.tensor(step_episode, dtype=torch.long), weight)
    return torch.repeat_interleave(per_turn, torch.tensor(counts, dtype=torch.long))


def rollout_advantages(episodes: list[Episode], values: torch.Tensor, gamma: float, lam: float, *,
                       estimator: str = "gae", normalize: bool = True,
                       step_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of every decision of the rollout, flat in rollout order (episodes,
    turns, forks); advantages whitened over the rollout when ``normalize``. float64.

    ``gae``: per decision, from ``values`` (``episode_gae``). ``grpo`` / ``rloo``: one advantage per
    episode, from its return against the other episodes of its game, given to each of its
    decisions; ``gigpo``: one per turn (``gigpo``, the turn's return discounted by ``gamma`` per
    step, ``step_weight``), given to each of the turn's decisions. Critic-free estimators' ``returns``
    hold the episode's return (no value target).
    """
    counts = [sum(len(s.action.decisions) for s in e.steps) for e in episodes]
    if estimator == "gigpo":
        advantages = _gigpo_decisions(episodes, gamma, step_weight)
        returns = torch.repeat_interleave(torch.tensor([e.total_return for e in episodes], dtype=torch.float64),
                                          torch.tensor(counts, dtype=torch.long))
    elif estimator == "gae":
        parts = [episode_gae(e, v, gamma, lam) for e, v in zip(episodes, values.split(counts))]
        advantages = torch.cat([a for a, _ in parts]) if parts else torch.zeros(0, dtype=torch.float64)
        returns = torch.cat([r for _, r in parts]) if parts else torch.zeros(0, dtype=torch.float64)
    else:
        totals = torch.tensor([e.total_return for e in episodes], dtype=torch.float64)
        group = {"grpo": grpo, "rloo": rloo}[estimator](totals, [e.game for e in episodes])
        advantages = torch.repeat_interleave(group, torch.tensor(counts, dtype=torch.long))
        returns = torch.repeat_interleave(totals, torch.tensor(counts, dtype=torch.long))
    if normalize and advantages.numel():
        advantages = whiten(advantages)
    return advantages, returns
