"""How much of a rollout's returns the value head *could* explain, fitted offline.

GAE needs a value head that predicts the returns; on the long games (medium, CookingWorld) the one
training fits explains almost none of their variance (``value/explained_variance`` within +-0.1).
This script separates the two possible reasons: the head trains too little, or the last hidden
state it reads does not say how an episode will end.

It plays ``--rollouts`` training rollouts with the policy as built (or ``model.init_from``), exactly
as iterations 0, 1, ... of ``python train.py <overrides>`` would before any update (same games,
seeds, temperature, exploration), and records at every decision the hidden state the value head
reads (the update's own forward, ``decision_forward``) and two targets: the GAE return training
uses (``ppo.lam``, from the rollout's value estimates) and the Monte Carlo return (lambda = 1,
bootstrapped only where the step limit cut the episode). Then it fits predictors on the first
rollout and scores them on the next one -- what training asks of the head (fit on iteration k,
predict iteration k+1's) -- as explained variance:

* ``head``: a fresh value head as built (same init), trained as the update trains it -- AdamW at
  ``ppo.lr_value`` over the update's own optimizer steps (``ppo.epochs`` passes of ``ppo.grad_accum``
  sequences, the loss ``vf_coef`` x 0.5 (V - R)^2 averaged per step, its norm clipped at
  ``ppo.max_grad_norm``) -- scored after 1, 3, 10, 30 and 100 iterations' worth of steps on the
  same rollout (an upper bound on what more steps per iteration would buy);
* ``ridge``: closed-form ridge regression on the standardised hidden states, for a range of
  penalties (the best is chosen on the scored rollout: an optimistic bound for a linear read-out);
* ``turn``: a quadratic in the turn number alone (what the step count says, without the text).

It runs in fp32 only (it plays without a Trainer, whose precision plugin would autocast): add
``memory=none`` where ``memory=auto`` chooses bf16.

    python bench/value_fit.py                                   # medium, RL alone, untrained policy
    python bench/value_fit.py --out bench/results/value_fit_cookingworld.json -- experiment=twx_cookingworld_cpu
"""

from __future__ import annotations

import argparse
import time

import torch

from compose import train_config  # bench/compose.py (the script directory is on sys.path)
from result import write_result  # bench/result.py
from textrl.config import ModelFacts, resolve
from textrl.policy.device import trainer_device
from textrl.policy.model import ValueHead, build_policy
from textrl.ppo.advantages import rollout_advantages
from textrl.ppo.losses import explained_variance
from textrl.ppo.sequences import decision_forward
from textrl.rollout import Sampling, episode_seeds, play_games
from textrl.training.curriculum import generate_games
from textrl.training.datamodule import RolloutDataModule
from textrl.training.module import PPOModule, temperature_at

ITERATIONS_WORTH = (1, 3, 10, 30, 100)
RIDGE = (1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0)


def record(module: PPOModule, curriculum, cfg, iteration: int) -> dict:
    """Iteration ``iteration``'s rollout as training would play it before any update: per decision,
    the hidden state the value head reads, the GAE and Monte Carlo returns, the turn number; and the
    update's optimizer steps over it (as lists of decision indices)."""
    played = curriculum.games(iteration)
    p = cfg.ppo
    sampling = Sampling(temperature_at(p, iteration), episode_seeds(cfg.seed, iteration, played.games), p.explore)
    start = time.perf_counter()
    episodes, _ = play_games(module.player, played.games, played.env, sampling)
    episodes = [e for e in episodes if e.aborted is None]
    played_s = time.perf_counter() - start
    data = module.update.prepare(episodes, iteration)
    values = data.targets.old_values.cpu().double()
    _, gae_returns = rollout_advantages(episodes, values, p.gamma, p.lam)
    _, mc_returns = rollout_advantages(episodes, values, p.gamma, 1.0)
    turns = torch.tensor([float(t) for e in episodes for t, s in enumerate(e.steps) for _ in s.action.decisions])
    policy = module.policy
    hidden = torch.zeros(len(values), policy.value_head.net[0].in_features)
    seen = {}
    hook = policy.value_head.register_forward_pre_hook(lambda m, args: seen.__setitem__("h", args[0]))
    try:
        with torch.no_grad():  # fp32 (main): no autocast to enter
            for s in data.sequences:
                out = decision_forward(policy, [s], module.update.pad_id, data.prefix)
                hidden[out.decisions.cpu()] = seen["h"].float().cpu()
    finally:
        hook.remove()
    steps = [[k for mb in step for seq in mb for k in seq.decisions] for step in data.steps]
    return {"hidden": hidden, "gae": gae_returns.float(), "mc": mc_returns.float(), "turn": turns,
            "steps": steps, "episodes": len(episodes), "wins": sum(e.won for e in episodes),
            "mean_len": sum(e.length for e in episodes) / max(len(episodes), 1), "played_s": played_s}


def fit_head(cfg, hidden_size: int, train: dict, test: dict, target: str, seed: int) -> dict:
    """A fresh value head trained as the update trains it, scored on ``test`` after each of
    ``ITERATIONS_WORTH`` iterations' worth of the update's optimizer steps over ``train``."""
    torch.manual_seed(seed)
    p = cfg.ppo
    head = ValueHead(hidden_size, cfg.model.value_hidden, -cfg.env.step_penalty)
    optimizer = torch.optim.AdamW(head.parameters(), lr=p.lr_value, weight_decay=p.weight_decay)  # the update's group
    x, y = train["hidden"], train[target]
    scores, done = {}, 0
    for worth in ITERATIONS_WORTH:
        for _ in range(worth - done):
            for step in train["steps"]:
                idx = torch.tensor(step)
                loss = p.vf_coef * 0.5 * (head(x[idx]) - y[idx]).pow(2).mean()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(list(head.parameters()), p.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        done = worth
        with torch.no_grad():
            scores[str(worth)] = {"test": explained_variance(head(test["hidden"]), test[target]),
                                  "train": explained_variance(head(x), y)}
    return scores


def ridge(train: dict, test: dict, target: str) -> dict:
    mean, std = train["hidden"].mean(0), train["hidden"].std(0) + 1e-6
    x = ((train["hidden"] - mean) / std).double()
    xt = ((test["hidden"] - mean) / std).double()
    y, y_mean = train[target].double(), train[target].double().mean()
    out = {}
    for lam in RIDGE:
        w = torch.linalg.solve(x.T @ x + lam * len(y) * torch.eye(x.shape[1], dtype=x.dtype), x.T @ (y - y_mean))
        out[str(lam)] = {"test": explained_variance((xt @ w + y_mean).float(), test[target]),
                         "train": explained_variance((x @ w + y_mean).float(), train[target])}
    return out


def by_turn(train: dict, test: dict, target: str) -> dict:
    def features(t):
        return torch.stack([torch.ones_like(t), t, t * t], 1).double()

    w = torch.linalg.lstsq(features(train["turn"]), train[target].double()[:, None]).solution
    return {"test": explained_variance((features(test["turn"]) @ w).squeeze(1).float(), test[target]),
            "train": explained_variance((features(train["turn"]) @ w).squeeze(1).float(), train[target])}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollouts", type=int, default=2, help="rollouts to record; fit on each, score on the next")
    ap.add_argument("--out", default="bench/results/value_fit.json")
    ap.add_argument("overrides", nargs="*", default=["experiment=medium_rl_rule_cpu"])
    args = ap.parse_args(argv)
    if args.rollouts < 2:
        ap.error(f"--rollouts {args.rollouts}: at least 2 (fit on one, score on the next)")

    cfg = train_config(args.overrides)
    if cfg.memory.precision != "32-true":  # it plays without a Trainer, whose precision plugin autocasts
        raise SystemExit(f"measure in fp32 (memory=none): this script has no autocast for {cfg.memory.precision}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    generate_games(cfg)
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty, cfg.cache_dir, cfg.memory,
                                     trainer_device(cfg.trainer))
    if cfg.model.init_from:
        from textrl.policy.checkpoint import load_policy_weights
        from textrl.training.run import init_from

        load_policy_weights(policy, init_from(cfg), cfg.memory.lora, f"model.init_from={cfg.model.init_from}")
    cfg = resolve(cfg, ModelFacts(policy.position_limit))  # the prompts within its positions, as train's
    datamodule = RolloutDataModule(cfg, policy.position_limit)
    datamodule.prepare_data()
    datamodule.setup("fit")
    module = PPOModule(cfg, policy, tokenizer)

    rollouts = []
    for it in range(args.rollouts):
        rollouts.append(record(module, datamodule.curriculum, cfg, it))
        r = rollouts[-1]
        print(f"rollout {it}: {r['episodes']} episodes, {r['wins']} won, {r['mean_len']:.1f} steps, "
              f"{len(r['gae'])} decisions, {r['played_s']:.0f} s", flush=True)

    hidden_size = rollouts[0]["hidden"].shape[1]
    pairs = []
    for k in range(len(rollouts) - 1):
        train, test = rollouts[k], rollouts[k + 1]
        pair = {"fit_on": k, "scored_on": k + 1}
        for target in ("gae", "mc"):
            pair[target] = {
                "target_std": {"fit": float(train[target].std()), "scored": float(test[target].std())},
                "head": fit_head(cfg, hidden_size, train, test, target, cfg.seed),
                "ridge": ridge(train, test, target),
                "turn": by_turn(train, test, target),
            }
        pairs.append(pair)
    result = {
        "overrides": args.overrides, "precision": cfg.memory.precision, "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rollouts": [{k: r[k] for k in ("episodes", "wins", "mean_len", "played_s")} |
                     {"decisions": len(r["gae"]), "optimizer_steps": len(r["steps"])} for r in rollouts],
        "iterations_worth": list(ITERATIONS_WORTH), "pairs": pairs,
    }
    write_result(args.out, result, argv)
    return result


if __name__ == "__main__":
    main()
