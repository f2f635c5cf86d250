"""textrl-attention on a tiny run's checkpoint: the PNGs, the per-layer objective share, and the
attention it draws is the model's own (output_attentions) for that prompt."""

import json
from dataclasses import replace

import pytest
import torch

from tests.conftest import config
import textrl.cli.train as cli
from textrl.cli.attention import main
from textrl.config import load_model_config
from textrl.policy.checkpoint import load_checkpoint_policy
from textrl.policy.model import build_policy


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    return cli.train(config(run, "iterations=1", "eval.before_training=false"))["last"]


def test_attention_command_draws_the_models_own_attention(checkpoint, tmp_path):
    out = tmp_path / "att"
    assert main(["--checkpoint", checkpoint, "--game", "1", "--games", "2", "--out", str(out)]) == 0
    for png in ("attention_layers.png", "objective_share.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((out / "attention.json").read_text())
    assert len(result["games"]) == 2 and result["games"][0]["game"] != result["games"][1]["game"]
    for name in ("base", "tuned"):  # the plotted share: the mean over the games
        mean = torch.tensor([g["objective_share"][name] for g in result["games"]]).mean(0)
        assert result["objective_share_mean"][name] == pytest.approx(mean.tolist(), abs=1e-6)
    saved = result["games"][0]
    ids, marked = saved["ids"], saved["objective_positions"]
    tuned, tokenizer, cfg = load_checkpoint_policy(checkpoint)
    assert saved["objective"] in tokenizer.decode([ids[i] for i in marked])  # the marked tokens hold it
    assert len(marked) < len(ids) / 2
    base, _ = build_policy(replace(load_model_config("tiny"), attn_implementation="eager"))
    for name, policy in (("tuned", tuned), ("base", base)):
        policy.lm.config._attn_implementation = "eager"  # output_attentions needs it
        with torch.no_grad():
            own = policy.lm(input_ids=torch.tensor([ids]), output_attentions=True).attentions
        expected = torch.stack([a[0, :, -1, :].mean(0) for a in own])
        drawn = torch.tensor(saved["attention"][name])
        assert drawn.shape == (cfg.model.architecture["num_hidden_layers"], len(ids))
        assert torch.allclose(drawn, expected, atol=1e-5)
        assert saved["objective_share"][name] == pytest.approx(drawn[:, marked].sum(-1).tolist(), abs=1e-5)
    assert not torch.allclose(torch.tensor(saved["attention"]["tuned"]), torch.tensor(saved["attention"]["base"]))
