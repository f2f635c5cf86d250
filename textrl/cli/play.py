"""textrl-play: play a TextWorld game by hand, or watch a model play it greedily.

    textrl-play                              # you type the commands (easy, held-out game 0)
    textrl-play --env medium --game 3        # any env option: tw_cooking, tw_coin, custom, ...
    textrl-play --model smollm2 --top 5      # the model plays; shows its 5 most likely commands
    textrl-play --checkpoint outputs/<date>/<time>/checkpoints/last.ckpt   # a trained policy plays

A model plays under the autocast it was trained and evaluated with (a checkpoint's
``memory.precision``; an untrained model: what ``memory=auto`` picks for it here), so it makes
the choices textrl-eval and the training transcripts show for the same game.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Callable

import torch

from textrl.config import EnvConfig, fit_to_positions, load_env_config
from textrl.games.env import InvalidCommandError, open_game
from textrl.games.pool import GamePool, GameSpec
from textrl.games.prompt import PromptBuilder, observation_text
from textrl.policy.checkpoint import CheckpointError
from textrl.policy.decoding import ConstrainedDecoder, score_commands
from textrl.policy.device import process_device
from textrl.policy.loading import load_policy
from textrl.policy.model import ModelNotFoundError, PolicyValueModel
from textrl.policy.speed import autocast_context


def _show(obs, step: int) -> None:
    print(f"\n--- step {step} | score {obs.score}/{obs.max_score} ---")
    if step == 0:
        print(f"GOAL: {obs.objective}\n")
    print(observation_text(obs))


def _ask(obs, read) -> str | None:
    print("\nadmissible: " + " | ".join(f"[{i}] {c}" for i, c in enumerate(obs.admissible_commands)))
    while True:
        line = read("> ")
        if line is None or line.strip() in {"quit", "exit"}:
            return None
        line = line.strip()
        if line.isdigit() and int(line) < len(obs.admissible_commands):
            return obs.admissible_commands[int(line)]
        if line in obs.admissible_commands:
            return line
        print(f"'{line}' is not admissible here; type one of the commands above or its number (quit to stop).")


def _load_player(args, device: torch.device) -> tuple[PolicyValueModel, PromptBuilder, EnvConfig, str]:
    """The model that plays (untrained by config name, or from a checkpoint), on ``device``, its
    prompt builder, environment settings (a checkpoint's own, so the policy sees what it was trained
    on) and precision (a checkpoint's: the one it was trained and evaluated with).

    Models are converted into the user's cache (``--cache-dir``), never the directory a checkpoint
    names: nothing read from a checkpoint decides where files are written."""
    policy, tokenizer, cfg, precision = load_policy(args.checkpoint, args.model, option="--checkpoint",
                                                    cache_dir=args.cache_dir, model_path=args.model_path, device=device)
    if cfg is not None:
        env = load_env_config(args.env).with_prompt_of(cfg.env) if args.env else cfg.env
    else:
        env = load_env_config(args.env or "easy")
    if args.max_prompt_tokens:
        env = replace(env, max_prompt_tokens=args.max_prompt_tokens)
    # prompts within the model's positions (GPT-2: 1,024)
    env = fit_to_positions(env, policy.position_limit)
    return policy, PromptBuilder.for_env(tokenizer, env), env, precision


def _read(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None


def _model_command(policy: PolicyValueModel, decoder: ConstrainedDecoder, prompts: PromptBuilder,
                   obs, history, top: int) -> str:
    """The model's greedy command, after its ``top`` most likely ones with their probabilities."""
    prompt, trie = prompts.build(obs, history), prompts.trie(obs)
    probs = score_commands(policy, prompt, trie)
    for command, p in sorted(probs.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {p:6.1%}  {command}")
    command = decoder.act([0], [prompt], [trie], greedy=True)[0].command
    print(f"> {command}")
    return command


def _run_game(env, next_command: Callable[[object], str | None]) -> int:
    """Play ``env`` to its end (or until ``next_command`` gives None: the player quits)."""
    obs = env.reset()
    step, total = 0, 0.0
    while True:
        _show(obs, step)
        command = next_command(obs)
        if command is None:
            print("bye")
            return 0
        try:
            result = env.step(command)
        except InvalidCommandError as exc:  # cannot happen for the model: the trie only holds admissible ones
            print(exc)
            continue
        step += 1
        total += result.reward
        obs = result.observation
        print(f"reward {result.reward:+.2f}")
        if result.done:
            _show(obs, step)
            outcome = "WON" if obs.won else ("LOST" if obs.lost else "out of steps")
            print(f"\n{outcome} after {step} steps, return {total:+.2f}")
            return 0


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="textrl-play", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", "--difficulty", dest="env", help="an env option (conf/env); default: the checkpoint's, else easy")
    ap.add_argument("--split", default="eval", choices=["train", "eval"])
    ap.add_argument("--game", type=int, default=0, help="game index within the split")
    ap.add_argument("--game-file", help="play this game file (.z8/.ulx, TextWorld's .json beside it) instead")
    player = ap.add_mutually_exclusive_group()
    player.add_argument("--model", help="a model config name (gpt2, qwen, smollm2, tiny): watch it play greedily")
    player.add_argument("--checkpoint", help="a training checkpoint: watch the trained policy play greedily "
                                             "(its prompt settings and precision are used)")
    ap.add_argument("--top", type=int, default=5, help="how many likely commands to show per step")
    ap.add_argument("--max-prompt-tokens", type=int, default=None, help="default: the checkpoint's, else the env option's")
    ap.add_argument("--model-path", default=None, help="the model directory a checkpoint was trained from (model.path=DIR); never taken from the checkpoint")
    ap.add_argument("--cache-dir", default=None, help="games and converted models (default: $TEXTRL_CACHE, else "
                                                      "~/.cache/textrl; never the directory a checkpoint names)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    policy = None
    device = process_device()  # this process's GPU (as training picks it), else the CPU
    try:
        env_cfg = load_env_config(args.env or "easy")  # a person's play
        if args.model or args.checkpoint:
            policy, prompts, env_cfg, precision = _load_player(args, device)
        path = args.game_file or GamePool(GameSpec.from_env(env_cfg), cache_dir=args.cache_dir) \
            .games(args.split, 1, start=args.game)[0]
        env = open_game(path, env_cfg)
    except (CheckpointError, ModelNotFoundError, ValueError) as exc:  # ConfigError and GameFileError too
        raise SystemExit(f"error: {exc}") from None
    print(f"game: {path}")
    try:
        if policy is None:
            return _run_game(env, lambda obs: _ask(obs, _read))
        # its inputs on the policy's device
        decoder = ConstrainedDecoder(policy, drop_cut_turns=env_cfg.drop_turns_from_cache)
        # one autocast for the whole game: the decoder's KV cache is kept in its dtype between turns
        with torch.no_grad(), autocast_context(precision, device, policy, args.cache_dir), \
                policy.weights_cast_once():
            return _run_game(env, lambda obs: _model_command(policy, decoder, prompts, obs, env.history, args.top))
    finally:
        env.close()


if __name__ == "__main__":
    sys.exit(main())
