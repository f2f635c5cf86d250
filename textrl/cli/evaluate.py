"""textrl-eval: greedy play on held-out games, with 95% confidence intervals and transcripts.

    textrl-eval --checkpoint outputs/<date>/<time>/checkpoints/best-12.ckpt  # a trained policy
    textrl-eval --model smollm2 --env medium --games 64                    # an untrained model
    textrl-eval --random --env hard                                        # uniformly random commands
    textrl-eval --checkpoint CKPT --env easy medium hard tw_cooking        # a generalization table
    textrl-eval --checkpoint CKPT --games my_games/ --max-steps 50         # any game files
    textrl-eval --checkpoint CKPT --first-game 500000                      # games no run ever plays
    textrl-eval --checkpoint CKPT --no-block-repeats --temperature 0.4     # the game as it is; sampled too

The games are the first N evaluation games of an env option (the same held-out set training
evaluates on; never a training game), the N from ``--first-game`` on (a large index: games of seeds
that neither training nor its evaluation ever plays, to check that a figure is not a fit to the
held-out set), or the given game files (``.z8``/``.ulx`` with TextWorld's
``.json`` beside them). A checkpoint plays other settings with the prompt it was trained with, and
with the fewest-played rule (``env.block_repeats``) if it was trained with it, unless
``--no-block-repeats`` (every admissible command: the game as it is) or ``--block-repeats`` says.
Writes ``<out>/results.json`` (win rate, steps, return: mean and 95% interval, how the lost games
failed (``textrl.failures``), plus every game) and ``<out>/transcripts.md`` (with a policy: the
other commands it considered at each step, with their probabilities, as training's transcripts);
several env options or checkpoints write one folder each under ``<out>`` (default
``eval/generalization``) and ``generalization.md`` / ``.json`` (policy x setting).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

import torch

from textrl.config import fit_to_positions, load_env_config
from textrl.games.env import check_game_file, open_game
from textrl.games.pool import GamePool, GameSpec
from textrl.games.prompt import PromptBuilder
from textrl.policy.checkpoint import CheckpointError
from textrl.policy.decoding import ConstrainedDecoder
from textrl.policy.loading import LoadedPolicy, load_policy
from textrl.policy.model import ModelNotFoundError
from textrl.policy.speed import autocast_context, resolve_precision
from textrl.rollout import Episode, Player, Sampling, episode_seeds, play_games, play_uniform
from textrl.results import summarize
from textrl.transcripts import transcript_rows, write_transcripts

log = logging.getLogger(__name__)


def game_files(paths: list[str]) -> list[Path]:
    """Game files named on the command line: files as given, directories searched for ``*.z8``,
    ``*.ulx`` and ``*.twx`` (sorted). Every file is checked before any is played."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            inside = sorted(q for q in p.rglob("*") if q.suffix in {".z8", ".ulx", ".twx"})
            if not inside:
                raise ValueError(f"--games {p}: the directory holds no .z8, .ulx or .twx game file")
            found += inside
        else:
            found.append(p)
    for path in found:
        check_game_file(path)
    return found


def load_source(policy_source: str, cache_dir: str | None = None, model_path: str | None = None,
                device: str | torch.device | None = None) -> LoadedPolicy | None:
    """``random`` (None), ``model:<name>`` (untrained) or ``checkpoint:<path>`` (``model_path``: the
    directory a checkpoint was trained from, given by the user), loaded by ``load_policy``."""
    if policy_source == "random":
        return None
    if policy_source.startswith("model:"):
        return load_policy(model=policy_source.removeprefix("model:"), cache_dir=cache_dir, device=device)
    if policy_source.startswith("checkpoint:"):
        return load_policy(policy_source.removeprefix("checkpoint:"), cache_dir=cache_dir, model_path=model_path,
                           device=device)
    raise ValueError(f"policy must be 'random', 'model:<name>' or 'checkpoint:<path>', got {policy_source!r}")


def evaluate(policy_source: str, env_name: str | None = None, *, games: int = 64, batch: int = 32, seed: int = 0,
             cache_dir: str | None = None, device: str | None = None, files: list[Path] | None = None,
             max_steps: int | None = None, loaded=None, transcripts: int | None = None,
             block_repeats: bool | None = None, first_game: int = 0,
             temperature: float | None = None) -> tuple[dict, list[Episode], list[list] | None]:
    """Play ``games`` held-out games of the env option ``env_name`` (default: the checkpoint's own
    setting, else easy), or the game ``files``. ``policy_source``: ``random``, ``model:<name>``
    (untrained) or ``checkpoint:<path>``; ``loaded``: its ``load_source`` result, to play several
    settings with one load (it plays on the device it was loaded on). ``device``: where ``load_source``
    puts the policy (None: ``process_device()``). Games are generated or found under ``cache_dir``
    (the user's, never a checkpoint's). Returns the summary, the episodes, and the transcript rows of
    the first ``transcripts`` episodes (None: all) with the policy's alternatives at each step (None
    for the random policy, which has none). ``block_repeats``: ``env.block_repeats`` for this play
    (None: as the checkpoint was trained, else off: the game as it is). ``first_game``: the index of
    the first evaluation game played (0: the held-out set training evaluates on). ``temperature``: a
    policy also plays the games sampled at it (one seed per game from ``seed``), summarised under
    ``sampled`` beside the greedy figures, never instead of them."""
    if loaded is None:
        loaded = load_source(policy_source, cache_dir, device=device)
    policy, tokenizer, cfg, precision = loaded or (None, None, None, None)  # the random policy: none
    if cfg is not None:
        # another setting's games, shown with the prompt the policy was trained with
        env = load_env_config(env_name).with_prompt_of(cfg.env) if env_name else cfg.env
    else:
        env = load_env_config(env_name or "easy")
    if max_steps is not None:
        env = replace(env, max_steps=max_steps)
    if block_repeats is not None:
        env = replace(env, block_repeats=block_repeats)
    if policy is not None:  # prompts within the model's positions (GPT-2: 1,024); one log line if capped
        env = fit_to_positions(env, policy.position_limit, cfg.model.name if cfg is not None else policy_source)
    if files is not None:
        paths, setting = files, "files"
    else:
        paths, setting = GamePool(GameSpec.from_env(env), cache_dir=cache_dir,
                                workers=env.workers).games("eval", games, start=first_game), env.name
    player = None
    if policy is not None:
        device = next(policy.parameters()).device  # load_source's (every input follows the policy)
        precision = resolve_precision(precision, policy, device, cache_dir)  # auto: as training decides it
        player = Player(policy, tokenizer, [ConstrainedDecoder(policy, drop_cut_turns=env.drop_turns_from_cache)],
                        autocast=lambda: autocast_context(precision, device))
    episodes, sampled = [], []
    for start in range(0, len(paths), batch):
        chunk = paths[start:start + batch]
        if player is not None:
            episodes += play_games(player, chunk, env)[0]
            if temperature is not None:
                sampling = Sampling(temperature, episode_seeds(seed, 0, chunk))
                sampled += play_games(player, chunk, env, sampling)[0]
        else:
            envs = [open_game(p, env) for p in chunk]
            try:
                episodes += play_uniform(envs, seed)[0]
            finally:
                for e in envs:
                    e.close()
        # An untrained model on medium/hard plays every game to the step limit: minutes per batch.
        log.info("played %d/%d %s games, %d won", len(episodes), len(paths), setting, sum(e.won for e in episodes))
    summary = {"policy": policy_source, "env": setting, "trained_on": cfg.env.name if cfg is not None else None,
               "max_steps": env.max_steps, "block_repeats": env.block_repeats, "greedy": policy is not None,
               "precision": precision, "first_game": None if files is not None else first_game,
               **summarize(episodes)}
    if sampled:
        summary["sampled"] = {"temperature": temperature, "seed": seed, **summarize(sampled)}
    rows = None
    if player is not None:  # the alternatives: one forward per step, under the policy's autocast
        with player.autocast():
            rows = transcript_rows(episodes[:transcripts], policy, PromptBuilder.for_env(tokenizer, env))
    return summary, episodes, rows


def generalization_table(summaries: list[dict]) -> str:
    """Markdown: one row per policy (with the setting it was trained on), one column per setting
    played; each cell the win rate and mean steps."""
    settings = list(dict.fromkeys(s["env"] for s in summaries))
    policies = list(dict.fromkeys((s["policy"], s["trained_on"]) for s in summaries))
    cell = {(s["policy"], s["env"]): f"{s['win_rate']['mean']:.2f} / {s['steps']['mean']:.1f}" for s in summaries}
    lines = ["| policy (trained on) | " + " | ".join(settings) + " |", "|---|" + "---|" * len(settings)]
    for policy, trained_on in policies:
        lines.append(f"| {policy} ({trained_on or '-'}) | " + " | ".join(cell.get((policy, e), "") for e in settings) + " |")
    return "\n".join(lines) + "\n\nEach cell: win rate / mean steps on held-out games (a model plays greedily).\n"


def write_result(summary: dict, episodes: list[Episode], out: Path, command: str, transcripts: int | None,
                 rows: list[list] | None = None) -> None:
    """``out/results.json`` and ``out/transcripts.md`` of one policy on one setting (``rows``: the
    transcript rows ``evaluate`` computed, with alternatives); prints the figures."""
    out.mkdir(parents=True, exist_ok=True)
    summary["command"] = command
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    shown = episodes if transcripts is None else episodes[:transcripts]
    write_transcripts(shown, out / "transcripts.md",
                      f"{summary['policy']} on {len(episodes)} {summary['env']} games: "
                      f"win rate {summary['win_rate']['mean']:.2f}", rows)
    print(f"{summary['policy']} on {summary['env']}:")
    for key in ("win_rate", "steps", "return"):
        lo, hi = summary[key]["ci95"]
        print(f"{key:>9}: {summary[key]['mean']:.3f}  (95% CI {lo:.3f} .. {hi:.3f})")
    if "sampled" in summary:
        s = summary["sampled"]
        lo, hi = s["win_rate"]["ci95"]
        print(f"  sampled at T={s['temperature']}: win_rate {s['win_rate']['mean']:.3f} (95% CI {lo:.3f} .. {hi:.3f}), "
              f"steps {s['steps']['mean']:.2f}")
    if summary["block_repeats"]:
        print("  played with the fewest-played rule (env.block_repeats): not the game as it is")
    failed = {k: c for k, c in summary["failures"].items() if c}
    if failed:
        print(" not won: " + ", ".join(f"{c} {k}" for k, c in failed.items()))
    print(f"wrote {out / 'results.json'} and {out / 'transcripts.md'}")


def write_table(summaries: list[dict], root: Path, command: str) -> None:
    """``root/generalization.md`` and ``.json`` from the results played so far."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "generalization.md").write_text(generalization_table(summaries))
    (root / "generalization.json").write_text(json.dumps(
        {"command": command, "results": [{k: v for k, v in s.items() if k != "per_game"} for s in summaries]},
        indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="textrl-eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", nargs="+", help="training checkpoints (.ckpt); several make table rows")
    which.add_argument("--model", help="an untrained model config: gpt2, qwen, smollm2, tiny")
    which.add_argument("--random", action="store_true", help="the uniformly random admissible-command baseline")
    ap.add_argument("--env", "--difficulty", nargs="+", dest="env",
                    help="env options to play (conf/env: easy, medium, hard, tw_cooking, ...); several give a "
                         "generalization table. Default: the checkpoint's own setting, else easy")
    ap.add_argument("--games", nargs="+", default=["64"],
                    help="how many held-out games to play (default 64), or game files / directories to play instead")
    ap.add_argument("--first-game", type=int, default=0,
                    help="index of the first held-out game (default 0: the games training evaluates on); a large "
                         "one, e.g. 500000, plays games of seeds no run ever plays")
    ap.add_argument("--max-steps", type=int, help="step limit (default: the env option's)")
    ap.add_argument("--block-repeats", action=argparse.BooleanOptionalAction, default=None,
                    help="--block-repeats: offer only the commands played fewest times from the same state in the "
                         "episode (env.block_repeats, a rule that changes the game); --no-block-repeats: every "
                         "admissible command, the game as it is. Default: as the checkpoint was trained, else off")
    ap.add_argument("--temperature", type=float,
                    help="a policy also plays each game sampled at this temperature, reported beside greedy")
    ap.add_argument("--batch", type=int, default=32, help="games decoded together")
    ap.add_argument("--seed", type=int, default=0, help="the random policy's seed, and the sampled play's (--temperature)")
    ap.add_argument("--transcripts", type=int, default=None, help="games to transcribe (default: all)")
    ap.add_argument("--out", help="output directory (default eval/<policy>-<env>)")
    ap.add_argument("--model-path", help="the model directory a checkpoint was trained from (model.path=DIR); never taken from the checkpoint")
    ap.add_argument("--cache-dir", help="games and converted models (default: $TEXTRL_CACHE or ~/.cache/textrl; "
                                        "never a checkpoint's)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    count = args.games[0] if len(args.games) == 1 and args.games[0].isdigit() else None
    if args.batch < 1 or (count is not None and int(count) < 1) or (args.max_steps is not None and args.max_steps < 1):
        ap.error("--games (a count), --batch and --max-steps must be >= 1")
    if args.temperature is not None and (args.random or not args.temperature > 0):
        ap.error("--temperature must be > 0, and goes with a policy (--checkpoint or --model), not --random")
    if args.first_game < 0 or (args.first_game and count is None):
        ap.error("--first-game must be >= 0, and goes with --games N (a count), not with game files")
    if count is None and args.env and len(args.env) > 1:
        ap.error("--games with game files plays those files: give at most one --env (its prompt and step limit)")
    sources = (["random"] if args.random else [f"model:{args.model}"] if args.model
               else [f"checkpoint:{c}" for c in args.checkpoint])
    settings = args.env or [None]
    command = " ".join(["textrl-eval", *(argv if argv is not None else sys.argv[1:])])
    single = len(sources) * len(settings) == 1
    root = Path(args.out or "eval/generalization")  # several results: one folder each under it
    names = ["random" if s == "random" else Path(s.split(":", 1)[1]).stem for s in sources]
    if len(set(names)) < len(names):  # e.g. two runs' last.ckpt
        names = [f"{k}-{n}" for k, n in enumerate(names)]
    summaries: list[dict] = []
    try:
        files = game_files(args.games) if count is None else None
        for source, name in zip(sources, names):
            loaded = load_source(source, args.cache_dir, args.model_path)
            for setting in settings:
                summary, episodes, rows = evaluate(source, setting, games=int(count or 0), batch=args.batch,
                                                   seed=args.seed, cache_dir=args.cache_dir, files=files,
                                                   max_steps=args.max_steps, loaded=loaded,
                                                   transcripts=args.transcripts,
                                                   block_repeats=args.block_repeats, first_game=args.first_game,
                                                   temperature=args.temperature)
                # written as soon as played (and the table so far): a long evaluation keeps what it did
                out = Path(args.out or f"eval/{name}-{summary['env']}") if single else root / f"{name}-{summary['env']}"
                write_result(summary, episodes, out, command, args.transcripts, rows)
                summaries.append(summary)
                if not single:
                    write_table(summaries, root, command)
    except (CheckpointError, ModelNotFoundError, ValueError) as exc:  # ConfigError and GameFileError too
        raise SystemExit(f"error: {exc}") from None
    if not single:
        print(generalization_table(summaries) + f"wrote {root / 'generalization.md'} and {root / 'generalization.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
