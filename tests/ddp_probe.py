"""``python tests/ddp_probe.py OUT_JSON override...``: ``train()`` under DDP with a probe on each rank,
run by tests/test_ddp.py (Lightning's launcher starts this script again for every other rank).

Each rank writes ``OUT_JSON.rank<r>``: how many gradient all-reduces DDP ran (a communication hook
counts the first bucket of each synchronised backward), how many optimizer steps the LM's AdamW
took (its own ``step`` state), the names of the buffers DDP broadcasts before each forward, and per
iteration the training games the rank played and the curriculum's lost games after it.
"""

import json
import sys
from pathlib import Path

import lightning as L
from hydra import compose, initialize_config_dir
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from textrl.cli.train import train  # noqa: E402
from textrl.config import CONF_DIR, to_train_config  # noqa: E402


class DDPProbe(L.Callback):
    def __init__(self, out: str):
        self.out, self.allreduces, self.played, self.lost = out, 0, [], []

    def on_train_start(self, trainer, pl_module):
        ddp = trainer.strategy.model

        def counting(state, bucket):
            if bucket.index() == 0:  # one synchronised backward, however many buckets it has
                self.allreduces += 1
            return default_hooks.allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, counting)
        self.broadcast = sorted(ddp.named_module_buffers)

    def on_train_batch_start(self, trainer, pl_module, curriculum, batch_idx):
        played = curriculum.games(trainer.current_epoch, trainer.global_rank, trainer.world_size)
        self.played.append([str(g) for g in played.games])

    def on_train_batch_end(self, trainer, pl_module, outputs, curriculum, batch_idx):
        self.lost.append([str(g) for g in curriculum.lost])

    def on_train_end(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]
        lm = optimizer.param_groups[0]["params"]
        steps = max(int(optimizer.state[p]["step"]) for p in lm if p in optimizer.state)
        Path(f"{self.out}.rank{trainer.global_rank}").write_text(json.dumps(
            {"allreduces": self.allreduces, "optimizer_steps": steps, "broadcast_buffers": self.broadcast,
             "played": self.played, "lost": self.lost}))


if __name__ == "__main__":
    out, overrides = sys.argv[1], sys.argv[2:]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = to_train_config(compose("train", overrides=overrides))
    train(cfg, callbacks=[DDPProbe(out)])
