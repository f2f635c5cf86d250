"""Two-process CPU DDP (gloo) through Lightning's strategy, launched as a user would."""

import csv
import json
import subprocess
import sys

from textrl.config import CONF_DIR
from tests.conftest import SMALL


def test_two_process_cpu_ddp_covers_both_ranks(tmp_path):
    cmd = [sys.executable, "train.py", *SMALL, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
           "iterations=2", "eval.every=1", "env.num_envs=4", f"hydra.run.dir={tmp_path}"]
    out = subprocess.run(cmd, cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in out.stderr + out.stdout
    with open(tmp_path / "logs" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    train_rows = [r for r in rows if r.get("rollout/episodes")]
    eval_rows = [r for r in rows if r.get("eval/games")]
    assert len(train_rows) == 2
    assert all(float(r["rollout/episodes"]) == 4 for r in train_rows)  # 2 per rank, summed
    assert all(float(r["eval/games"]) == 4 for r in eval_rows)  # each rank its own 2 evaluation games
    # the evaluation file holds every rank's games, each once (gathered; rank 0 writes it)
    written = json.loads((tmp_path / "evaluation" / "iter_0002.json").read_text())
    assert written["games"] == 4 and len({g["game"] for g in written["per_game"]}) == 4
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def test_a_rank_without_games_finishes_and_gradients_sync_once_per_optimizer_step(tmp_path):
    """One training game and one fixed training game for two ranks: rank 1 plays nothing, yet joins
    every collective (it used to return before one and hang until the gloo/NCCL timeout). Each
    optimizer step of two accumulated minibatches all-reduces the gradients once (``no_sync`` on
    the first), and the KL anchor's reference copy is not among the buffers DDP broadcasts."""
    out = tmp_path / "probe.json"
    cmd = [sys.executable, "tests/ddp_probe.py", str(out), f"output_dir={tmp_path}", *SMALL, "memory=none",
           "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "iterations=2", "eval.every=1",
           "env.num_envs=1", "env.decode_groups=1", "eval.games=1", "eval.train_games=1", "eval.batch=1",
           "eval.probes=1", "ppo.kl_coef=0.1", "ppo.minibatch_size=1", "ppo.grad_accum=2"]
    run = subprocess.run(cmd, cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"probe.json.rank{r}").read_text()) for r in (0, 1)]
    for probe in ranks:
        assert probe["optimizer_steps"] >= 2  # two iterations, at least one step each
        assert probe["allreduces"] == probe["optimizer_steps"]  # not one per backward (twice as many)
        assert probe["broadcast_buffers"] and not any(b.startswith("reference.") for b in probe["broadcast_buffers"])
    rows = [r for r in csv.DictReader(open(tmp_path / "logs" / "metrics.csv")) if r.get("rollout/episodes")]
    assert [float(r["rollout/episodes"]) for r in rows] == [1.0, 1.0]  # rank 0's one episode, summed


def test_ranks_replay_one_shared_list_of_lost_games(tmp_path):
    """Two ranks, 2 of 4 games each, half of each iteration's games replays of lost ones: both ranks
    keep the same lost list (every rank's lost games, as rank 0's checkpoint saves it), so they
    draw the same replays and never play the same game twice in one iteration."""
    out = tmp_path / "probe.json"
    cmd = [sys.executable, "tests/ddp_probe.py", str(out), f"output_dir={tmp_path}", *SMALL, "memory=none",
           "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "iterations=3", "eval.every=3",
           "eval.games=2", "eval.train_games=0", "eval.probes=0", "eval.transcripts=0", "curriculum.replay=0.5",
           "ppo.epochs=1", "env.max_steps=3"]
    run = subprocess.run(cmd, cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"probe.json.rank{r}").read_text()) for r in (0, 1)]
    assert ranks[0]["lost"] == ranks[1]["lost"] and ranks[0]["lost"][0]  # the tiny policy loses in 3 steps
    for it, (mine, theirs) in enumerate(zip(ranks[0]["played"], ranks[1]["played"])):
        assert len(mine) == len(theirs) == 2 and not set(mine) & set(theirs), it
    assert set(ranks[0]["lost"][0]) <= set(ranks[0]["played"][0] + ranks[1]["played"][0])


def test_ranks_with_unequal_shares_give_the_one_process_gradient(tmp_path):
    """Four real episodes, 3 on rank 0 and 1 on rank 1 (gloo): the all-reduced gradient of the
    update's optimizer step equals one process's over all four (rank 1's episode weighs once, not
    once per sequence rank 0 has more)."""
    out = tmp_path / "gradient.json"
    run = subprocess.run([sys.executable, "tests/ddp_gradient.py", str(out)], cwd=CONF_DIR.parent,
                         capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["names"] and result["max_abs"] > 0
    assert result["max_abs_diff"] <= 1e-5 * result["max_abs"]
