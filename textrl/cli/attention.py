"""textrl-attention: where the policy looks when it chooses, before and after fine-tuning.

For one observation (a game's opening one), the attention from the position that makes the first
decision of the command (the prompt's last token, plus any forced tokens before the first fork) to
every earlier token, averaged over heads, layer by layer, for the base model and the fine-tuned
policy; the objective's tokens are marked. Writes to ``--out``:

* ``attention_layers.png``: one panel per layer, attention over the prompt's tokens, base vs tuned,
  the objective's tokens shaded;
* ``objective_share.png``: per layer, the share of that attention on the objective's tokens;
* ``attention.json``: the numbers behind both (tokens, objective positions, per-layer attention).

With ``--games N`` the share is the mean over the opening observations of N games (the panels show
the first).

    textrl-attention --checkpoint outputs/<run>/checkpoints/last.ckpt            # base: its model config
    textrl-attention --checkpoint CKPT --base smollm2 --env easy --game 3 --out attention/
    textrl-attention --checkpoint CKPT --games 16 --out attention/

The models run with eager attention for this command only (the others use SDPA, which does not
return attention weights), under the checkpoint's autocast (``memory.precision``: what the policy
computes when it plays); every model family works. Models are converted into the user's cache
(``--cache-dir``), never the directory a checkpoint names.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from textrl.config import fit_to_positions, load_env_config, load_model_config
from textrl.games.env import open_game
from textrl.games.pool import GamePool, GameSpec, game_name
from textrl.games.prompt import PromptBuilder
from textrl.policy.checkpoint import CheckpointError
from textrl.policy.decoding import Cursor
from textrl.policy.loading import load_policy
from textrl.policy.model import ModelNotFoundError
from textrl.policy.speed import autocast_context


@torch.no_grad()
def attention_to_prompt(policy, ids: list[int]) -> torch.Tensor:
    """[layers, len(ids)]: the attention of the last position to every position, mean over heads."""
    device = next(policy.parameters()).device  # the inputs go where the policy is (a GPU, the CPU)
    out = policy.lm(input_ids=torch.tensor([ids], device=device), output_attentions=True, logits_to_keep=1)
    return torch.stack([a[0, :, -1, :].float().mean(0) for a in out.attentions])


def objective_positions(tokenizer, ids: list[int], objective: str) -> list[int]:
    """The tokens whose text overlaps an occurrence of the objective (the system message's, and the
    one before the command with ``env.goal_last``)."""
    ends = [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]
    text = tokenizer.decode(ids)
    spans, start = [], text.find(objective)
    while start >= 0:
        spans.append((start, start + len(objective)))
        start = text.find(objective, start + 1)
    starts = [0, *ends[:-1]]
    return [i for i, (a, b) in enumerate(zip(starts, ends)) if any(a < e and b > s for s, e in spans)]


def opening_attention(path, game, prompts: PromptBuilder, models: dict) -> dict:
    """The attention of each model's first decision at ``game``'s opening observation, with the
    prompt's tokens and which of them hold the objective."""
    obs = game.reset()
    game.close()
    trie = prompts.trie(obs)
    ids = prompts.build(obs, []) + Cursor(trie).new  # the tokens before the first decision
    tokenizer = prompts.tokenizer
    marked = objective_positions(tokenizer, ids, obs.objective)
    layers = {name: attention_to_prompt(policy, ids) for name, policy in models.items()}
    return {"game": game_name(path), "objective": obs.objective, "ids": ids,
            "tokens": tokenizer.convert_ids_to_tokens(ids), "objective_positions": marked,
            "objective_share": {name: a[:, marked].sum(-1).tolist() for name, a in layers.items()},
            "attention": {name: a.tolist() for name, a in layers.items()}}


def load_models(checkpoint: str, base: str | None, cache_dir: str | None = None, model_path: str | None = None,
                device: torch.device | None = None):
    """(tuned, base, tokenizer, the checkpoint's config), both with eager attention on ``device``
    (None: ``process_device()``); models converted into ``cache_dir`` (None: $TEXTRL_CACHE or
    ~/.cache/textrl), never the checkpoint's."""
    tuned, tokenizer, cfg, _ = load_policy(checkpoint, option="--checkpoint", cache_dir=cache_dir, model_path=model_path,
                                           device=device, attn_implementation="eager")
    untrained = load_policy(model=load_model_config(base) if base else cfg.model, cache_dir=cache_dir, device=device,
                            attn_implementation="eager")
    if untrained.tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"--base {base} has another tokenizer than the checkpoint's model "
                                 f"({cfg.model.name}): the prompts would differ; use the same model family")
    return tuned, untrained.policy, tokenizer, cfg


def plot(out: Path, tokens: list[str], marked: list[int], layers: dict[str, torch.Tensor], shares: dict[str, list[float]],
         title: str, games: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = next(iter(layers.values())).shape[0]
    cols = min(6, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.0 * rows), sharex=True, squeeze=False)
    x = range(len(tokens))
    for layer in range(rows * cols):
        ax = axes[layer // cols][layer % cols]
        if layer >= n:
            ax.axis("off")
            continue
        for i in marked:
            ax.axvspan(i - 0.5, i + 0.5, color="gold", alpha=0.35, linewidth=0)
        for name, values in layers.items():
            ax.plot(x, values[layer].tolist(), linewidth=0.8, label=name)
        ax.set_title(f"layer {layer}", fontsize=8)
        ax.tick_params(labelsize=6)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"{title}\nattention of the first decision's position to each prompt token (mean over heads); "
                 f"objective tokens shaded", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "attention_layers.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, values in shares.items():
        ax.plot(range(len(values)), values, marker="o", markersize=3, label=name)
    ax.set_xlabel("layer")
    ax.set_ylabel("attention on the objective")
    ax.set_title(title if games == 1 else f"mean over the opening observations of {games} games", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "objective_share.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="textrl-attention", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="the fine-tuned policy")
    ap.add_argument("--base", help="a model config name (smollm2, gpt2, qwen, tiny); default: the checkpoint's model, untrained")
    ap.add_argument("--env", help="an env option; default: the checkpoint's")
    ap.add_argument("--split", default="eval", choices=["train", "eval"])
    ap.add_argument("--game", type=int, default=0, help="game index within the split (the first of --games)")
    ap.add_argument("--games", type=int, default=1, help="games whose objective shares are averaged (panels: the first)")
    ap.add_argument("--game-file", help="this game file instead")
    ap.add_argument("--out", default="attention", help="folder for the PNGs and attention.json")
    ap.add_argument("--model-path", default=None, help="the model directory a checkpoint was trained from (model.path=DIR); never taken from the checkpoint")
    ap.add_argument("--cache-dir", default=None, help="games and converted models (default: $TEXTRL_CACHE, else "
                                                      "~/.cache/textrl; never the directory a checkpoint names)")
    args = ap.parse_args(argv)
    try:
        tuned, base, tokenizer, cfg = load_models(args.checkpoint, args.base, args.cache_dir, args.model_path)
        env = load_env_config(args.env).with_prompt_of(cfg.env) if args.env else cfg.env
        # prompts within both models' positions (GPT-2: 1,024); one log line if capped
        limit = min(filter(None, (tuned.position_limit, base.position_limit)), default=None)
        env = fit_to_positions(env, limit)
        paths = [args.game_file] if args.game_file else \
            GamePool(GameSpec.from_env(env), cache_dir=args.cache_dir).games(args.split, args.games, start=args.game)
        games = [open_game(p, env) for p in paths]
    except (CheckpointError, ModelNotFoundError, ValueError) as exc:  # ConfigError and GameFileError too
        raise SystemExit(f"error: {exc}") from None
    prompts = PromptBuilder.for_env(tokenizer, env)
    # both models under the autocast the tuned policy was trained and evaluated with, on their device
    device = next(tuned.parameters()).device
    with autocast_context(cfg.memory.precision, device, tuned, args.cache_dir), tuned.weights_cast_once(), \
            base.weights_cast_once():
        per_game = [opening_attention(path, game, prompts, {"base": base, "tuned": tuned})
                    for path, game in zip(paths, games)]
    # the share per layer, mean over the games; the panels show the first game
    shares = {name: torch.tensor([g["objective_share"][name] for g in per_game]).mean(0).tolist()
              for name in ("base", "tuned")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    first = per_game[0]
    plot(out, first["tokens"], first["objective_positions"],
         {name: torch.tensor(a) for name, a in first["attention"].items()}, shares,
         f"{first['game']}: {first['objective'][:90]}", len(per_game))
    for g in per_game[1:]:  # the full attention of the game the panels show; shares for all
        del g["attention"]
    (out / "attention.json").write_text(json.dumps({
        "checkpoint": args.checkpoint, "base": args.base or cfg.model.name, "objective_share_mean": shares,
        "games": per_game, "command": "textrl-attention " + " ".join(argv if argv is not None else sys.argv[1:]),
    }) + "\n")
    print(f"attention of the first decision on the objective, per layer, mean over {len(per_game)} game(s): base -> tuned")
    for layer, (b, t) in enumerate(zip(shares["base"], shares["tuned"])):
        print(f"  layer {layer:2d}: {b:.3f} -> {t:.3f}")
    print(f"wrote {out}/attention_layers.png, objective_share.png, attention.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
