"""Checkpoints hold what training changes: with ``model.trainable_layers`` the frozen blocks and
embeddings are left out and come back from the model config, checked by fingerprint. Real tiny
training runs."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

import textrl.cli.train as cli
from textrl.policy.checkpoint import CheckpointError, load, load_checkpoint_policy
from tests.conftest import StopAfter, config, table

import pytest

TOP1 = ["model.trainable_layers=1"]  # the tiny model has 2 blocks: embeddings and block 0 frozen


def test_top_n_checkpoints_leave_the_frozen_weights_out_and_load_them_back(tmp_path):
    slim = cli.train(config(tmp_path / "top1", "iterations=1", *TOP1))
    full = cli.train(config(tmp_path / "all", "iterations=1"))
    state = load(slim["last"])
    keys = set(state["state_dict"])
    assert not any(k.startswith(("policy.lm.model.embed_tokens.", "policy.lm.model.layers.0.", "policy.lm.lm_head."))
                   for k in keys)
    assert any(k.startswith("policy.lm.model.layers.1.") for k in keys) and "policy.value_head.net.0.weight" in keys
    assert len(state["textrl"]["frozen"]["fingerprint"]) == 64
    size_slim = (tmp_path / "top1" / "checkpoints" / "last.ckpt").stat().st_size
    size_full = (tmp_path / "all" / "checkpoints" / "last.ckpt").stat().st_size
    assert size_slim < 0.5 * size_full  # the tiny model's weights are mostly its embeddings

    policy, _, _ = load_checkpoint_policy(slim["last"])
    trained = slim["module"].policy.state_dict()
    loaded = policy.state_dict()
    assert set(loaded) == set(trained) and all(torch.equal(loaded[k], trained[k]) for k in trained)


def test_a_slim_checkpoint_refuses_other_frozen_weights(tmp_path):
    run = cli.train(config(tmp_path / "run", "iterations=1", *TOP1))
    state = load(run["last"])
    state["textrl"]["config"]["model"]["init_seed"] = 1  # the same architecture, other random weights
    other = tmp_path / "other.ckpt"
    torch.save(state, other)
    with pytest.raises(CheckpointError, match="trained on other frozen weights"):
        load_checkpoint_policy(other)


def test_a_slim_run_resumes_exactly(tmp_path):
    common = ["iterations=2", "eval.every=1", *TOP1]
    straight = cli.train(config(tmp_path / "straight", *common))
    cli.train(config(tmp_path / "split", *common), callbacks=[StopAfter(1)])
    assert "frozen" in load(tmp_path / "split" / "checkpoints" / "last.ckpt")["textrl"]
    resumed = cli.train(config(tmp_path / "x", *common, f"ckpt_path={tmp_path / 'split' / 'checkpoints' / 'last.ckpt'}"))
    a, b = straight["module"].policy.state_dict(), resumed["module"].policy.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert table(tmp_path / "straight") == table(tmp_path / "split")


def test_frozen_weights_brought_by_init_from_are_kept_in_checkpoints(tmp_path):
    everything = cli.train(config(tmp_path / "all", "iterations=1"))  # every block trained: other lower weights
    run = cli.train(config(tmp_path / "top1", "iterations=1", "eval.before_training=false", *TOP1,
                           f"model.init_from={everything['last']}"))
    state = load(run["last"])
    assert "frozen" not in state["textrl"] and "policy.lm.model.layers.0.mlp.up_proj.weight" in state["state_dict"]
    policy, _, _ = load_checkpoint_policy(run["last"])
    trained = run["module"].policy.state_dict()
    assert all(torch.equal(policy.state_dict()[k], trained[k]) for k in trained)
    assert OmegaConf.select(OmegaConf.create(state["textrl"]["config"]), "model.trainable_layers") == 1


def _mapped_from(tensor: torch.Tensor, path) -> bool:
    """Whether the tensor's memory lies in a mapping of the file ``path`` (Linux's /proc/self/maps)."""
    address, target = tensor.untyped_storage().data_ptr(), str(path.resolve())
    for line in open("/proc/self/maps"):
        fields = line.split()
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high:
            return len(fields) > 5 and fields[5] == target
    return False


def test_checkpoints_are_read_memory_mapped_and_writing_to_them_leaves_the_file(tmp_path):
    """Lightning's resume (``AtomicCheckpointIO.load_checkpoint``) and textrl's own reads
    (``read_checkpoint``: resume checks, textrl-eval/play/export) map the file instead of copying it:
    the ranks of a requeued DDP job on one node share its pages."""
    from textrl.training.callbacks import AtomicCheckpointIO
    from textrl.policy.checkpoint import read_checkpoint
    path = tmp_path / "last.ckpt"
    state = {"state_dict": {"w": torch.zeros(1 << 16)}, "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(8)}}}],
             "textrl": {"config": {}}}
    AtomicCheckpointIO().save_checkpoint(state, path)
    resumed = AtomicCheckpointIO().load_checkpoint(path)
    _, read = read_checkpoint(path)
    for loaded in (resumed, read):
        assert _mapped_from(loaded["state_dict"]["w"], path)
        assert _mapped_from(loaded["optimizer_states"][0]["state"][0]["exp_avg"], path)
    resumed["state_dict"]["w"].add_(1.0)  # an optimizer step on a loaded state: copy-on-write
    assert load(path)["state_dict"]["w"].sum() == 0 and read["state_dict"]["w"].sum() == 0
