"""best-N.ckpt: the held-out evaluation with the best win rate so far, the final one included, also
when the run's length is not a multiple of eval.every."""

from pathlib import Path

import textrl.cli.train as cli
from tests.conftest import StopAfter, config, read_metrics
from textrl.policy.checkpoint import load


def evaluations(run_dir) -> list[tuple[int, float]]:
    """(iteration, eval/win_rate) of every evaluation row of metrics.csv, in order."""
    return [(int(float(r["iteration"])), float(r["eval/win_rate"])) for r in read_metrics(run_dir) if r.get("eval/win_rate")]


def checkpoints(run_dir) -> set[str]:
    return {p.name for p in (Path(run_dir) / "checkpoints").iterdir()}


def check_best(result, evals: list[tuple[int, float]]) -> None:
    """The one best file is the first evaluation with the top win rate (mode max keeps the earlier of
    equals), it holds that policy and score, and train() returns its path."""
    top = max(rate for _, rate in evals)
    iteration = next(it for it, rate in evals if rate == top)
    best = Path(result["run_dir"]) / "checkpoints" / f"best-{iteration}.ckpt"
    assert checkpoints(result["run_dir"]) == {"last.ckpt", best.name}
    assert result["best"] == str(best)
    state = load(best)
    assert state["textrl"]["iterations_done"] == iteration
    for ckpt in (state, load(best.parent / "last.ckpt")):  # a resumed run's `best` knows it too
        (saved,) = [s for k, s in ckpt["callbacks"].items() if "eval/win_rate" in k]  # the `best` callback's state
        assert (saved["best_model_path"], float(saved["best_model_score"])) == (str(best), top)


def test_the_final_evaluation_is_judged_when_iterations_are_not_a_multiple_of_eval_every(tmp_path):
    # seed 3: on the machines this was written on, the final evaluation (iteration 3) is strictly the best
    result = cli.train(config(tmp_path, "iterations=3", "eval.every=2", "seed=3"))
    evals = evaluations(tmp_path)
    assert [it for it, _ in evals] == [0, 2, 3]  # before training, every 2nd iteration, the last: one row each
    check_best(result, [e for e in evals if e[0] > 0])  # iteration 0 is the untrained policy: never a checkpoint
    assert {p.name for p in (tmp_path / "transcripts").iterdir()} == {"iter_0000.md", "iter_0002.md", "iter_0003.md"}


def test_a_run_shorter_than_eval_every_keeps_its_only_evaluation_as_the_best(tmp_path):
    result = cli.train(config(tmp_path, "iterations=1", "eval.every=2", "eval.before_training=false"))
    assert [it for it, _ in evaluations(tmp_path)] == [1]
    check_best(result, evaluations(tmp_path))
    assert checkpoints(tmp_path) == {"last.ckpt", "best-1.ckpt"}


def test_a_resumed_run_evaluates_its_last_iteration_too(tmp_path):
    common = ["iterations=3", "eval.every=2", "eval.before_training=false"]
    cli.train(config(tmp_path, *common), callbacks=[StopAfter(2)])
    assert [it for it, _ in evaluations(tmp_path)] == [2]
    resumed = cli.train(config(tmp_path / "elsewhere", *common, f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}"))
    evals = evaluations(tmp_path)
    assert [it for it, _ in evals] == [2, 3]
    check_best(resumed, evals)
