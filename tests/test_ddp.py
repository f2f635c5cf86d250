"""Two-process CPU DDP (gloo) through Lightning's strategy, launched as a user would."""

import csv
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
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
