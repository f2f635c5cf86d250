"""The figures bench/learn.py, bench/iteration.py, bench/families.py, bench/value_fit.py and
bench/food_split.py compute, on synthetic inputs (no training): minutes to a held-out win rate, the
model FLOPs of a forward and a backward, whether a game family counts as learned, how much of the
next rollout's returns a predictor fitted on one rollout explains, and what training showed of a
held-out recipe."""

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
# noqa: E402 below: bench/ is a script directory, not a package
import families  # noqa: E402
import learn  # noqa: E402
import textrl.ppo.update as update_module  # noqa: E402
from iteration import Counts, ModelFlops, blocks_of  # noqa: E402
from learn import eval_minutes, from_stored, minutes_to, reached, wall_eval_minutes, win_rate  # noqa: E402
from textrl.config import TrainConfig, load_model_config  # noqa: E402
from food_split import group_of  # noqa: E402
from value_fit import by_turn, fit_head, ridge  # noqa: E402
from textrl.policy.decoding import ConstrainedDecoder  # noqa: E402
from textrl.policy.model import build_policy  # noqa: E402
from textrl.policy.trie import CommandTrie  # noqa: E402
from textrl.ppo.sequences import TrainingSequence  # noqa: E402


def _train(iteration, rollout, update, recompute=""):
    return {"iteration": f"{iteration}.0", "perf/rollout_s": str(rollout), "perf/recompute_s": str(recompute),
            "perf/reference_s": "", "perf/update_s": str(update), "eval/win_rate": "", "perf/eval_s": ""}


def _eval(iteration, win_rate, seconds):
    return {"iteration": f"{iteration}.0", "eval/win_rate": str(win_rate), "perf/eval_s": str(seconds),
            "perf/rollout_s": ""}


# metrics.csv rows as csv.DictReader reads them: a warm start's row, an evaluation before training,
# four iterations of 60 s (20 + 5 + 35) with an evaluation after the 2nd and the 4th
ROWS = [{"iteration": "0.0", "warm_start/loss": "1.2", "perf/rollout_s": ""}, _eval(0, 0.0, 30),
        _train(1, 20, 35, 5), _train(2, 20, 35, 5), _eval(2, 0.5, 12),
        _train(3, 20, 35, 5), _train(4, 20, 35, 5), _eval(4, 0.84375, 18)]


def test_minutes_to_each_win_rate_from_the_logged_phases():
    curve = eval_minutes(ROWS)
    # 30 s; 30 + 2 x 60 + 12 = 162 s; 162 + 2 x 60 + 18 = 300 s
    assert curve == [[0, 0.5, 0.0], [2, 2.7, 0.5], [4, 5.0, 0.84375]]
    assert minutes_to(curve) == {"0.5": 2.7, "0.8": 5.0, "0.9": None}  # 0.5 reached exactly counts
    # the run's wall time (10 minutes for 5 logged) spreads what no phase logs in proportion
    assert eval_minutes(ROWS, total_minutes=10) == [[0, 1.0, 0.0], [2, 5.4, 0.5], [4, 10.0, 0.84375]]


def test_minutes_aggregate_over_the_seeds_that_reached_each_win_rate():
    runs = [{"seed": 1, "minutes_to_win_rate": {"0.5": 2.0, "0.8": 4.0, "0.9": None}},
            {"seed": 2, "minutes_to_win_rate": {"0.5": 3.0, "0.8": None, "0.9": None}},
            {"seed": 3}]  # recorded before these figures: left out
    out = reached(runs)
    assert out["0.5"] == {"mean": 2.5, "std": 0.71, "reached": "2/2", "seeds": [1, 2], "values": [2.0, 3.0]}
    assert out["0.8"]["mean"] == 4.0 and out["0.8"]["reached"] == "1/2" and out["0.8"]["std"] == 0.0
    assert out["0.9"] == {"mean": None, "std": None, "reached": "0/2", "seeds": [1, 2], "values": [None, None]}


def test_wall_clock_minutes_from_the_evaluations_transcript_files(tmp_path):
    started = 1_000_000.0
    (tmp_path / "transcripts").mkdir()
    for iteration, seconds in ((0, 30), (2, 180)):
        path = tmp_path / "transcripts" / f"iter_{iteration:04d}.md"
        path.write_text("")
        os.utime(path, (started + seconds, started + seconds))
    one = [(started, 600.0)]
    assert wall_eval_minutes(tmp_path, one, [[0, 0.0, 8.0], [2, 0.5, 4.0]]) == [[0, 0.5, 0.0], [2, 3.0, 0.5]]
    assert wall_eval_minutes(tmp_path, one, [[0, 0.0, 8.0], [4, 0.9, 2.0]]) is None  # no transcript: no wall clock
    # a resumed run: the file of iteration 2 was written 60 s into the second stretch, which began
    # a day later, after a first stretch that counts 120 s
    os.utime(tmp_path / "transcripts" / "iter_0002.md", (started + 86_460, started + 86_460))
    two = [(started, 120.0), (started + 86_400, 300.0)]
    assert wall_eval_minutes(tmp_path, two, [[0, 0.0, 8.0], [2, 0.5, 4.0]]) == [[0, 0.5, 0.0], [2, 3.0, 0.5]]
    # a file outside every stretch (written after the last checkpoint of a killed one): no wall clock
    assert wall_eval_minutes(tmp_path, [(started, 20.0), (started + 86_400, 30.0)], [[0, 0.0, 8.0]]) is None


def test_minutes_estimated_from_a_stored_result_file(tmp_path):
    run = {"seed": 1, "minutes": 10.0, "iterations": 4, "eval_curve": [[0, 0.0, 8.0], [2, 0.5, 4.0], [4, 0.9, 2.0]],
           "seconds_per_iteration": {"rollout": 20.0, "recompute_old": 5.0, "reference": None, "update": 35.0,
                                     "evaluation": 20.0}}
    path = tmp_path / "learn_x_default.json"
    path.write_text(json.dumps({"runs": [run]}))
    out = from_stored(path)
    # logged: 4 x 60 + 3 x 20 = 300 s over a 600 s run: each point's logged seconds x 2
    assert out["runs"][0]["eval_minutes"] == [[0, 0.67, 0.0], [2, 5.33, 0.5], [4, 10.0, 0.9]]
    assert out["runs"][0]["minutes_to_win_rate"] == {"0.5": 5.33, "0.8": 10.0, "0.9": 10.0}


def test_stored_files_side_by_side_keep_the_minutes_their_runs_recorded(tmp_path):
    """A run that recorded its minutes to each win rate keeps them (not the estimate from its means);
    the wins' interval is the seeds' mean as a rate over the held-out games, not over the plays."""
    run = {"seed": 1, "minutes": 10.0, "iterations": 4, "eval_curve": [[0, 0.0, 8.0], [4, 0.9, 2.0]],
           "seconds_per_iteration": {"rollout": 20.0, "update": 35.0, "evaluation": 20.0},
           "eval_minutes": [[0, 1.0, 0.0], [4, 9.0, 0.9]], "clock": "wall",
           "minutes_to_win_rate": {"0.5": 9.0, "0.8": 9.0, "0.9": 9.0}, "eval_win_rate": 0.9}
    path = tmp_path / "learn_x_default.json"
    path.write_text(json.dumps({"runs": [run, {**run, "seed": 2, "eval_win_rate": 0.95}], "eval_games": 64,
                                "eval_episode_len": {"mean": 2.0}}))
    out = from_stored(path)
    assert out["runs"][0]["minutes_to_win_rate"] == {"0.5": 9.0, "0.8": 9.0, "0.9": 9.0}
    assert out["minutes_to_win_rate"]["0.9"]["reached"] == "2/2"
    assert out["eval_win_rate"] == win_rate([0.9, 0.95], 64)
    assert out["eval_win_rate"]["mean"] == 0.925
    # n = 64 games: over the 128 plays it would be [0.866, 0.959]
    assert out["eval_win_rate"]["ci95"] == [0.834, 0.968]
    assert win_rate([1.0], 64)["ci95"][1] == 1.0 and win_rate([0.0], 64)["ci95"][0] == 0.0


def test_stored_runs_count_the_walkthroughs_and_the_ppo_episodes_to_each_win_rate(tmp_path):
    """Each environment plays one episode an iteration: PPO episodes are iterations x env.num_envs, and
    those before the first evaluation reaching a win rate are its iteration x env.num_envs (0 at the
    cloned start); RL alone clones no walkthrough; a run that recorded no config counts nothing."""
    def run(steps, curve):
        return {"seed": 1, "minutes": 10.0, "iterations": 12, "eval_minutes": curve, "clock": "wall",
                "minutes_to_win_rate": {"0.5": 1.0}, "eval_curve": [],
                "resolved": {"env": {"num_envs": 16}, "warm_start": {"steps": steps, "games": 512}}}
    path = tmp_path / "learn_x_default.json"
    path.write_text(json.dumps({"runs": [run(128, [[0, 4.0, 0.84], [6, 6.0, 0.95], [12, 9.0, 0.97]]),
                                         run(0, [[0, 1.0, 0.0], [6, 5.0, 0.6], [12, 9.0, 0.85]]),
                                         {k: v for k, v in run(0, [[12, 9.0, 0.5]]).items() if k != "resolved"}]}))
    cloned, rl_alone, unrecorded = (r["episodes"] for r in from_stored(path)["runs"])
    assert cloned == {"walkthroughs": 512, "ppo": 192, "ppo_to_win_rate": {"0.5": 0, "0.8": 0, "0.9": 96}}
    assert rl_alone == {"walkthroughs": 0, "ppo": 192, "ppo_to_win_rate": {"0.5": 96, "0.8": 192, "0.9": None}}
    assert unrecorded is None


def test_out_without_stored_files_is_refused(capsys):
    """--out only writes what --from-stored reads: alone it would write nothing, so it is refused."""
    with pytest.raises(SystemExit):
        learn.main(["--out", "x.json"])
    assert "--from-stored" in capsys.readouterr().err


def _tiny(**overrides):
    torch.manual_seed(0)
    policy, tokenizer = build_policy(replace(load_model_config("tiny"), **overrides))
    return policy, tokenizer


# conf/model/tiny.yaml: hidden 64, intermediate 128, 4 heads of 16, 2 key/value heads, 2 layers.
# Per block: q 64x64 + k 64x32 + v 64x32 + o 64x64 + gate, up 64x128 + down 128x64 = 36,864 linear
# weights; attention width 4 x 16 = 64. 10 tokens at positions 0..9 attend to 1 + ... + 10 = 55 keys.
W, A, T, KEYS = 36_864, 64, 10, 55


def test_flops_of_the_tiny_model_from_its_config():
    policy, _ = _tiny()  # every block trains
    flops = ModelFlops.of(policy.lm)
    assert flops == ModelFlops(linear=[W, W], trainable=[W, W], attention=[A, A], lowest_trainable=0)
    forward = 2 * (2 * W * T + 4 * A * KEYS)  # 2 blocks: 1,502,720
    assert flops.forward(T, KEYS) == forward == 1_502_720
    assert flops.backward(T, KEYS) == 2 * forward  # trainable blocks: input and weight gradients
    # the update's forwards run the last block's MLP (gate, up 64x128, down 128x64) at the read positions only
    mlp = 3 * 64 * 128
    skipping = ModelFlops.of(policy.lm, skips_last_mlp=True)
    assert (skipping.last_mlp, skipping.last_mlp_trainable) == (mlp, mlp) and (flops.last_mlp, flops.last_mlp_trainable) == (0, 0)
    assert skipping.skipped(T - 2, backward=False) == 2 * mlp * (T - 2)
    assert skipping.skipped(T - 2, backward=True) == (2 + 4) * mlp * (T - 2)  # and its input and weight gradients

    top, _ = _tiny(trainable_layers=1)  # block 0 frozen under block 1: no backward reaches it
    flops = ModelFlops.of(top.lm)
    assert flops.lowest_trainable == 1 and flops.trainable == [0, W]
    assert flops.forward(T, KEYS, first_block=1) == 2 * W * T + 4 * A * KEYS  # the frozen block replayed
    assert flops.backward(T, KEYS) == 4 * W * T + 8 * A * KEYS

    for p in blocks_of(policy.lm)[1].parameters():  # a frozen block above a trainable one
        p.requires_grad_(False)
    flops = ModelFlops.of(policy.lm)
    assert flops.lowest_trainable == 0 and flops.trainable == [W, W - W]
    # block 0: 2x its forward; block 1: input gradients only (1x) on its weights, attention's 2x
    assert flops.backward(T, KEYS) == (4 * W * T + 8 * A * KEYS) + (2 * W * T + 8 * A * KEYS)


def test_counted_tokens_and_keys_of_the_decoders_calls_and_the_updates_forward():
    policy, tokenizer = _tiny()
    policy.eval()
    trie = CommandTrie(["go north", "go south", "look"], lambda s: [200 + ord(c) for c in s], tokenizer.eos_token_id)
    original = ConstrainedDecoder._feed
    counts = Counts()
    with counts.wrapping(), torch.no_grad():
        assert counts.error is None
        decoder = ConstrainedDecoder(policy)
        first = [list(range(300, 305)), list(range(300, 309))]
        decoder.act([0, 1], first, [trie, trie], greedy=True)  # outside a training step: not counted
        assert counts.iterations == []
        counts.current = {}
        decoder.reset()
        actions = decoder.act([0, 1], first, [trie, trie], greedy=True)
        decoder.act([0, 1], [p + a.command_ids + [400] for p, a in zip(first, actions)], [trie, trie], greedy=True)
        # every token attends to its row's cache before it and itself: a row of n tokens, n (n + 1) / 2
        fed = [len(f) for f in decoder.fed]
        assert counts.current["rollout"]["tokens"] == sum(decoder.counts[k] for k in ("prefill_tokens", "fork_tokens"))
        assert counts.current["rollout"]["keys"] == sum(n * (n + 1) // 2 for n in fed)
        sequences = [TrainingSequence(0, 0, list(range(300, 310)), [9], [[201, 202]], [201]),
                     TrainingSequence(1, 1, list(range(300, 306)), [5], [[201, 202]], [202])]
        update_module.decision_forward(policy, sequences, tokenizer.pad_token_id)
        assert counts.current["update"] == {"tokens": 16, "keys": 55 + 21, "replayed_tokens": 0, "replayed_keys": 0,
                                            "read_tokens": 2}  # one decision each
    assert ConstrainedDecoder._feed is original  # put back


def _policy(wins, lo, hi, steps, failures, games):
    return {"win_rate": {"mean": wins, "ci95": [lo, hi]}, "steps": {"mean": steps, "ci95": [steps - 1, steps + 1]},
            "max_steps": 20, "failures": failures, "command": "textrl-eval ...",
            "games": games, "aborted": [], "per_game": [{"won": False}] * games}


def test_family_table_rows_and_the_learned_verdict(tmp_path, monkeypatch):
    """bench/families.py: a row appears only once all three policies and the training run are on disk;
    learned = trained beats random by >= 0.20 or wins >= 0.90; the failure kinds of the trained policy."""
    monkeypatch.setattr(families, "ROOT", tmp_path)
    monkeypatch.setattr(families, "OUT", tmp_path / "families")
    cases = {"twx_coin": (0.67, 0.86, {"goal_not_taken": 9}),     # +0.19, below 0.90: not learned
             "tw_coin": (0.22, 0.42, {}),                         # +0.20 exactly: learned
             "twx_sorting": (0.95, 0.92, {"loop": 5})}            # below random, but >= 0.90: learned
    for family, (random, trained, failures) in cases.items():
        for name, wins in (("random", random), ("untrained", 0.0), ("trained", trained)):
            out = tmp_path / "families" / family / name
            out.mkdir(parents=True)
            fails = {"loop": 0, "goal_not_taken": 0, **(failures if name == "trained" else {})}
            games = families.UNTRAINED_GAMES if name == "untrained" else families.GAMES
            (out / "results.json").write_text(json.dumps(_policy(wins, 0.0, 1.0, 9.5, fails, games)))
        if family == "twx_sorting":
            continue  # no training run on disk yet: no row
        learned = tmp_path / "bench" / "results" / f"learn_family_{family}_default.json"
        learned.parent.mkdir(parents=True, exist_ok=True)
        learned.write_text(json.dumps({
            "minutes": {"mean": 12.5}, "eval_win_rate": {"mean": trained}, "precision": "bf16-mixed",
            "command": "python bench/learn.py ...",
            "runs": [{"iterations": 12, "commit": "abc1234", "rollout_curve": [[1, 0.5, 9.0]]}]}))
    assert families.row("twx_sorting") is None
    coin, tw_coin = families.row("twx_coin"), families.row("tw_coin")
    assert (coin["learned"], tw_coin["learned"]) == (False, True)
    table = families.table([coin, tw_coin])
    assert ("| `twx_coin` (20) | 0.67 [0.00, 1.00] / 9.5 | 0.00 [0.00, 1.00] / 9.5 (32 games) "
            "| 0.86 [0.00, 1.00] / 9.5 | 12.5 | no | goal_not_taken 9 |") in table
    assert "| `tw_coin` (20) |" in table and "| yes | - |" in table
    # the sorting family reached 0.92 while random won 0.95: still learned by the 0.90 bar
    learned = tmp_path / "bench" / "results" / "learn_family_twx_sorting_default.json"
    learned.write_text((tmp_path / "bench" / "results" / "learn_family_tw_coin_default.json").read_text())
    assert families.row("twx_sorting")["learned"] is True


def test_the_trained_row_is_taken_from_the_runs_final_evaluation_when_it_played_64_games(tmp_path, monkeypatch):
    """bench/families.py, step 4: a run's own final evaluation (evaluation/iter_<k>.json, as training
    writes it) becomes the trained row, with the training command; one of another size, or none,
    leaves the row to textrl-eval."""
    monkeypatch.setattr(families, "ROOT", tmp_path)
    run = tmp_path / "outputs" / "run"
    (run / "evaluation").mkdir(parents=True)
    (run / "transcripts").mkdir()
    train = {"command": "python bench/learn.py --tag family_twx_coin", "runs": [{"run_dir": "outputs/run", "iterations": 12}]}
    out = tmp_path / "families" / "twx_coin" / "trained"
    assert not families.from_training(train, out)  # no evaluation file: textrl-eval plays it
    final = _policy(0.86, 0.0, 1.0, 4.1, {"loop": 9}, families.GAMES)
    (run / "evaluation" / "iter_0012.json").write_text(json.dumps({**final, "games": 63, "aborted": [{"game": "g"}]}))
    (run / "evaluation" / "iter_0006.json").write_text(json.dumps(_policy(0.5, 0.0, 1.0, 9.0, {}, families.GAMES)))
    (run / "transcripts" / "iter_0012.md").write_text("# Greedy evaluation after iteration 12\n")
    assert families.from_training(train, out)  # 63 played + 1 aborted: the 64 games
    result = json.loads((out / "results.json").read_text())
    assert result["win_rate"] == final["win_rate"] and result["failures"] == {"loop": 9}  # iteration 12's, not 6's
    assert result["command"].startswith("python bench/learn.py --tag family_twx_coin (its final evaluation")
    assert (out / "transcripts.md").read_text().startswith("# Greedy evaluation after iteration 12")
    other = tmp_path / "families" / "tw_coin" / "trained"
    (run / "evaluation" / "iter_0012.json").write_text(json.dumps(_policy(0.5, 0.0, 1.0, 9.0, {}, 32)))
    assert not families.from_training(train, other) and not other.exists()  # 32 games: not the row's 64


def _rollout(generator, n=240, dim=8, weights=None):
    """value_fit's record of a rollout, synthetic: hidden states, turn numbers, the update's steps
    (groups of 40 decisions), and targets read from the hidden state (``gae``) or the turn (``mc``)."""
    hidden = torch.randn(n, dim, generator=generator)
    turn = torch.arange(n, dtype=torch.float32) % 24
    return {"hidden": hidden, "turn": turn, "gae": hidden @ weights, "mc": 1 + 0.3 * turn - 0.02 * turn * turn,
            "steps": [list(range(i, min(i + 40, n))) for i in range(0, n, 40)]}


def test_value_fit_scores_each_predictor_on_the_next_rollout():
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(8, generator=g)
    fit, scored = _rollout(g, weights=weights), _rollout(g, weights=weights)
    # a target linear in the hidden state: ridge at a small penalty explains all of the next
    # rollout's variance, a large one shrinks to the mean (explained variance 0)
    out = ridge(fit, scored, "gae")
    assert out["0.01"]["test"] > 0.99 and abs(out["1000.0"]["test"]) < 0.05
    # a target quadratic in the turn: the turn predictor is exact; the hidden state (noise here)
    # carries nothing to the next rollout
    assert by_turn(fit, scored, "mc")["test"] > 0.999 and by_turn(fit, scored, "gae")["test"] < 0.1
    assert ridge(fit, scored, "mc")["1.0"]["test"] < 0.1
    # the head as the update trains it: scored after each number of iterations' worth of steps,
    # and learning the linear target with enough of them
    head = fit_head(TrainConfig(), 8, fit, scored, "gae", seed=0)
    assert list(head) == ["1", "3", "10", "30", "100"]
    assert head["100"]["test"] > 0.8 > head["1"]["test"]


def test_food_split_groups_a_recipe_by_what_training_showed():
    foods, prepared = {"carrot", "water"}, {("carrot", "raw", "sliced"), ("water", "raw", "uncut")}
    assert group_of([("red hot pepper", "roasted", "diced")], foods, prepared) == "unseen food"
    assert group_of([("carrot", "fried", "diced")], foods, prepared) == "seen food, unseen preparation"
    assert group_of([("water", "raw", "uncut")], foods, prepared) == "seen food and preparation"
    # one new food beside a seen one is not a recipe of new foods
    assert group_of([("carrot", "fried", "diced"), ("pepper", "raw", "uncut")], foods, prepared) \
        == "seen food, unseen preparation"


def test_a_random_play_run_counts_its_random_episodes_and_no_walkthrough(tmp_path):
    run = {"seed": 1, "minutes": 10.0, "iterations": 12, "eval_minutes": [[0, 4.0, 0.6], [12, 9.0, 0.85]],
           "clock": "wall", "minutes_to_win_rate": {"0.5": 4.0}, "eval_curve": [],
           "warm_start": {"warm_start/random_episodes": 4321.0},
           "resolved": {"env": {"num_envs": 32}, "warm_start": {"steps": 128, "games": 1024, "source": "random_play"}}}
    path = tmp_path / "learn_x_default.json"
    path.write_text(json.dumps({"runs": [run]}))
    assert from_stored(path)["runs"][0]["episodes"] == {
        "walkthroughs": 0, "random_play": 4321, "ppo": 384, "ppo_to_win_rate": {"0.5": 0, "0.8": 384, "0.9": None}}
