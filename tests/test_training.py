"""End-to-end PPO training on real games with the real tiny model."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

import textrl.cli.train as cli
from tests.conftest import SMALL, Snapshot, StopAfter, config, read_metrics, table
from textrl.config import CONF_DIR
from textrl.policy.model import build_policy
import textrl.ppo.sequences as sequences_module
from textrl.ppo.sequences import decision_forward, token_packs
from textrl.rollout import Sampling, episode_seeds, play_games
from textrl.training.callbacks import AtomicCheckpointIO
from textrl.training.module import PPOModule


def test_two_iterations_end_to_end(tmp_path):
    cfg = config(tmp_path, "iterations=2", "eval.every=1")
    snapshot = Snapshot()
    result = cli.train(cfg, callbacks=[snapshot])
    changed = snapshot.changed(result["module"])
    assert any(k.startswith("lm.") for k in changed) and any(k.startswith("value_head.") for k in changed)

    rows = read_metrics(tmp_path)
    train_rows = [r for r in rows if r.get("loss/policy")]
    eval_rows = [r for r in rows if r.get("eval/win_rate")]
    assert [float(r["iteration"]) for r in train_rows] == [1.0, 2.0]
    assert [float(r["iteration"]) for r in eval_rows] == [0.0, 1.0, 2.0]
    for key in ["rollout/win_rate", "rollout/return", "rollout/episode_len", "loss/value", "loss/entropy",
                "policy/approx_kl", "policy/clipfrac", "policy/ratio_mean", "value/explained_variance",
                "value/corr", "optim/grad_norm", "optim/grad_norm_value", "optim/lr_lm", "optim/lr_value",
                "rollout/temperature", "perf/rollout_s", "perf/update_s", "perf/tokens_per_s"]:
        assert train_rows[0][key] != "", key
    assert all(r["perf/eval_s"] != "" for r in eval_rows) and all(not r.get("perf/eval_s") for r in train_rows)
    # fit vs generalisation: greedy play on fixed training games beside the held-out ones, and how
    # undecided the verb choice (first fork) is
    assert all(r["eval/train_win_rate"] != "" and float(r["eval/first_fork_entropy"]) > 0 for r in eval_rows)
    assert all(float(r["eval/games"]) == 4 for r in eval_rows)  # held-out games only
    # the temperature this iteration's rollout sampled at: T0 at the first iteration, T0 x 0.995 at the second
    assert [float(r["rollout/temperature"]) for r in train_rows] == pytest.approx([1.0, 0.995])
    # cosine from lr_lm at the first iteration to exactly lr_lm_min at the last
    assert [float(r["optim/lr_lm"]) for r in train_rows] == pytest.approx([cfg.ppo.lr_lm, cfg.ppo.lr_lm_min])
    assert float(train_rows[1]["optim/lr_value"]) == pytest.approx(cfg.ppo.lr_value)  # its own, not decayed
    for r in train_rows:  # fresh data + unchanged weights: every ratio of the first minibatch is 1
        assert float(r["policy/first_logratio_max"]) < 1e-4
    assert (tmp_path / "transcripts" / "iter_0002.md").read_text().count("- command: `") >= 2
    assert Path(result["last"]).name == "last.ckpt" and Path(result["best"]).is_file()


def rollout(cfg, games, iteration=0):
    """The module's update object and one iteration's prepared data from a real sampled rollout."""
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty)
    module = PPOModule(cfg, policy, tokenizer)
    sampling = Sampling(1.0, episode_seeds(cfg.seed, iteration, games))
    episodes, _ = play_games(module.player, games, cfg.env, sampling)
    return module.update, module.update.prepare(episodes, iteration)


@pytest.mark.parametrize("history, keep", [(8, ""), (2, ""), (3, "look,inventory,examine,go,open,take")],
                         ids=["whole-history", "cut-history", "cut-keeping-answers"])
def test_first_minibatch_ratio_is_one_for_every_decision(tmp_path, easy_pool, monkeypatch, history, keep):
    """history 2: from the third turn on every prompt cuts the oldest turn, which the decoder drops
    from its cache (textrl.policy.speed.stream): the update's forward over the stream must hide it too.
    Keeping answers (env.keep_answers), a cut can pass over a middle turn: two stretches go, which the
    decoder does not drop from its cache; the row starts again from position 0, a new sequence."""
    update, data = rollout(config(tmp_path, f"env.history_len={history}", "env.drop_turns_from_cache=true",
                                  f"env.keep_answers=[{keep}]"), easy_pool.games("train", 4))
    assert any(s.drops for s in data.sequences) == (history < 8)
    first = sorted(data.sequences, key=lambda s: -len(s.drops))[:2]
    # both in one packed forward, whatever their lengths: the second's cuts shifted behind the first
    lengths = [len(s.input_ids) for s in first]
    monkeypatch.setattr(sequences_module, "PACK_TOKENS", sum(lengths))
    assert token_packs(lengths, sequences_module.PACK_TOKENS) == [(0, 2)]
    with torch.no_grad():
        terms, _ = update.loss(first, data, 1.0)
        out = decision_forward(update.policy, first, update.pad_id)
        alone = [decision_forward(update.policy, [s], update.pad_id) for s in first]
    assert terms.log_ratio.numel() >= 2
    assert float(terms.log_ratio.abs().max()) < 1e-4
    assert torch.allclose(out.values, data.targets.old_values[out.decisions], atol=1e-4)
    # packed back to back, each sequence's cuts hidden from its later turns as when it is alone
    assert torch.allclose(out.values, torch.cat([a.values for a in alone]), atol=1e-5)
    width = out.logits.shape[1]
    logits = torch.cat([torch.nn.functional.pad(a.logits, (0, width - a.logits.shape[1])) for a in alone])
    assert torch.allclose(out.logits[out.valid], logits[out.valid], atol=1e-4)


def test_an_optimizer_steps_gradient_does_not_depend_on_how_it_is_split(tmp_path, easy_pool):
    """The gradient of one optimizer step is the mean over its decisions: one minibatch of all its
    sequences, or several accumulated minibatches of different sizes, give the same gradient."""
    update, data = rollout(config(tmp_path, "env.max_steps=3"), easy_pool.games("train", 6))
    sequences = data.sequences
    assert len(sequences) >= 5 and len({len(s.tokens) for s in sequences}) > 1  # unequal sequences
    n = float(sum(len(s.tokens) for s in sequences))
    params = [q for q in update.policy.parameters() if q.requires_grad]

    def gradient(split):
        for q in params:
            q.grad = None
        for minibatch in split:
            terms, _ = update.loss(minibatch, data, n)
            terms.loss.backward()
        return [q.grad.clone() if q.grad is not None else torch.zeros_like(q) for q in params]

    whole = gradient([sequences])
    for split in ([sequences[:1], sequences[1:4], sequences[4:]], [[s] for s in sequences]):
        for a, b in zip(whole, gradient(split)):
            assert torch.allclose(a, b, atol=1e-5, rtol=0)
    assert any(float(g.abs().max()) > 1e-6 for g in whole)


@pytest.mark.parametrize("start", [[], ["warm_start.steps=2", "warm_start.games=4", "ppo.kl_coef=0.1"]],
                         ids=["rl_alone", "warm_start_and_kl_anchor"])
def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path, start):
    """The default's path too (a warm start, then PPO anchored to the warm-started policy): the
    resumed run neither clones the walkthroughs again nor anchors to the weights it resumed with."""
    common = ["iterations=4", "eval.every=2", *start]
    straight = cli.train(config(tmp_path / "straight", *common))
    cli.train(config(tmp_path / "split", *common), callbacks=[StopAfter(2)])
    last = tmp_path / "split" / "checkpoints" / "last.ckpt"
    resumed = cli.train(config(tmp_path / "elsewhere", *common, f"ckpt_path={last}"))
    assert resumed["run_dir"] == tmp_path / "split"  # the same run continues

    a = straight["module"].policy.state_dict()
    b = resumed["module"].policy.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert table(tmp_path / "straight") == table(tmp_path / "split")
    assert resumed["trainer"].current_epoch == 4


def test_a_run_killed_with_sigkill_resumes_from_last_ckpt_like_an_uninterrupted_run(tmp_path):
    """`python train.py` is SIGKILLed as soon as iteration 2's last.ckpt is on disk (it is then
    inside iteration 3, with no chance to clean up), resumed from last.ckpt, and must end with the
    weights and the metrics of a run that was never interrupted."""
    from textrl.policy.checkpoint import load

    args = [sys.executable, "train.py", *SMALL, "memory=none", "iterations=6", "eval.every=2", "eval.transcripts=0"]
    straight = subprocess.run([*args, f"hydra.run.dir={tmp_path / 'straight'}"], cwd=CONF_DIR.parent,
                              capture_output=True, text=True, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]

    killed = tmp_path / "killed"
    last = killed / "checkpoints" / "last.ckpt"
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen([*args, f"hydra.run.dir={killed}"], cwd=CONF_DIR.parent, stdout=log, stderr=log)
    done = 0
    deadline = time.time() + 600
    while done < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
        if last.is_file():
            done = load(last)["textrl"]["iterations_done"]
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, f"the run ended by itself: {(tmp_path / 'killed.log').read_text()[-2000:]}"
    assert 2 <= load(last)["textrl"]["iterations_done"] < 6

    resumed = subprocess.run([*args, f"ckpt_path={last}", f"hydra.run.dir={tmp_path / 'resumed'}"],
                             cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = load(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    b = load(last)
    assert a["textrl"]["iterations_done"] == b["textrl"]["iterations_done"] == 6
    assert all(torch.allclose(a["state_dict"][k], b["state_dict"][k], atol=1e-6) for k in a["state_dict"])
    assert table(tmp_path / "straight") == table(killed)


def test_last_ckpt_is_written_after_every_iteration(tmp_path):
    """With eval.every > 1, Lightning's save_last alone wrote last.ckpt only at the end of training."""
    from textrl.policy.checkpoint import load

    seen = []

    class Watch(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            last = Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
            seen.append(load(last)["textrl"]["iterations_done"] if last.is_file() else None)

    cli.train(config(tmp_path, "iterations=4", "eval.every=3"), callbacks=[Watch()])
    assert seen == [None, 1, 2, 3]


def test_checkpoint_write_killed_midway_leaves_the_previous_one_usable(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"weights": torch.arange(5)}, path)

    def dies_halfway(obj, f, *a, **k):
        f.write(b"partial bytes of a checkpoint")
        raise KeyboardInterrupt  # the run is killed in the middle of the write

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"weights": torch.arange(9)}, path)
    monkeypatch.undo()
    assert torch.equal(io.load_checkpoint(path)["weights"], torch.arange(5))


def test_bad_checkpoint_fails_before_training(tmp_path):
    with pytest.raises(cli.CheckpointError, match="does not exist"):
        cli.train(config(tmp_path, f"ckpt_path={tmp_path / 'missing.ckpt'}"))
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(b"\x80\x04truncated")
    with pytest.raises(cli.CheckpointError, match="not a readable checkpoint"):
        cli.train(config(tmp_path, f"ckpt_path={broken}"))
    # a missing file names the checkpoints beside it (a warm-start-only run writes no last.ckpt)
    with pytest.raises(cli.CheckpointError, match=r"last.ckpt does not exist.*holds: broken.ckpt\)"):
        cli.train(config(tmp_path, f"ckpt_path={tmp_path / 'last.ckpt'}"))


def test_resuming_with_another_kl_anchor_setting_fails_before_training(tmp_path):
    """A run started without the KL anchor (the default until 68aee23) holds no reference policy:
    resumed with the anchor, it would anchor to the weights it was built with, so it is refused."""
    cli.train(config(tmp_path / "run", "iterations=2"), callbacks=[StopAfter(1)])
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    with pytest.raises(cli.CheckpointError, match=r"trained with ppo.kl_coef=0; this run has ppo.kl_coef=0.1"):
        cli.train(config(tmp_path / "again", "iterations=2", "ppo.kl_coef=0.1", f"ckpt_path={last}"))


class Payload:
    """An object whose unpickling would run code (``__reduce__``): a checkpoint must not hold one."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_checkpoint_holding_code_is_refused_not_run(tmp_path):
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "optimizer_states": [], "textrl": {"config": {}}, "x": Payload()}, evil)
    with pytest.raises(cli.CheckpointError, match="other than tensors and plain data"):
        cli.train(config(tmp_path, f"ckpt_path={evil}"))


def test_wandb_logger_runs_offline_without_a_key(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    import logging

    with caplog.at_level(logging.INFO):
        cli.train(config(tmp_path, "logger=wandb", "iterations=1", "seed=3"))
    assert "logging offline" in caplog.text
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    os.environ.pop("WANDB_MODE", None)


def test_wandb_uses_the_key_that_wandb_login_stored_in_netrc(tmp_path, monkeypatch):
    """`wandb login` writes the key to ~/.netrc (or $NETRC): that user is online, not offline.
    Nothing is sent: the logger is only built, its run is not started."""
    from textrl.training.loggers import make_logger, wandb_api_key

    key = "0123456789abcdef0123456789abcdef01234567"
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {key}\n")
    netrc.chmod(0o600)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(netrc))
    assert wandb_api_key() == key
    logger = make_logger(config(tmp_path, "logger=wandb"), tmp_path, None)
    assert logger._offline is False
    monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
    assert make_logger(config(tmp_path, "logger=wandb"), tmp_path, None)._offline is True


def test_resuming_drops_the_logged_rows_of_the_iteration_the_kill_interrupted(tmp_path):
    """A run killed after logging iteration 3 but before its checkpoint resumes from iteration 2:
    iteration 3 is played again, so its first rows must go (the evaluation before training stays)."""
    from textrl.training.loggers import ResumableCSVLogger

    logs = tmp_path / "logs"
    logs.mkdir()
    rows = ["epoch,iteration,eval/win_rate,loss/policy", "0,0.0,0.1,", "0,1.0,,0.5", "1,2.0,,0.4", "1,2.0,0.3,",
            "2,3.0,,0.2"]
    (logs / "metrics.csv").write_text("\n".join(rows) + "\n")
    logger = ResumableCSVLogger(save_dir=tmp_path, name="", version="logs", resume_iteration=2)
    logger.log_metrics({"iteration": 3.0, "loss/policy": 0.25}, step=3)
    logger.save()
    assert [(r["iteration"], r["loss/policy"]) for r in read_metrics(tmp_path)] == [
        ("0.0", ""), ("1.0", "0.5"), ("2.0", "0.4"), ("2.0", ""), ("3.0", "0.25")]


def test_init_from_starts_a_new_run_with_exactly_the_checkpoints_policy(tmp_path):
    """model.init_from: the first rollout and the evaluation before training use the checkpoint's
    policy (its weights, its greedy play); optimizer, schedules and iterations start anew."""
    first = cli.train(config(tmp_path / "first", "iterations=2", "eval.every=2"))
    snapshot = Snapshot()
    second = cli.train(config(tmp_path / "second", "iterations=1", "env=medium", "env.max_steps=8",
                              f"model.init_from={first['last']}"), callbacks=[snapshot])
    trained = first["module"].policy.state_dict()
    assert all(torch.equal(snapshot.weights[k], trained[k]) for k in trained)
    rows = read_metrics(tmp_path / "second")
    assert float(rows[0]["iteration"]) == 0 and float(rows[1]["iteration"]) == 1  # a new run, iteration 1
    assert float(rows[1]["optim/lr_lm"]) == pytest.approx(second["module"].cfg.ppo.lr_lm)  # a new schedule
    with pytest.raises(cli.CheckpointError, match="holds a policy of model=tiny.*this run uses model=smollm2"):
        cli.train(config(tmp_path / "third", "model=smollm2", f"model.init_from={first['last']}"))


def test_a_job_frees_what_it_built_before_the_next_job_in_the_same_process(tmp_path, monkeypatch):
    """Hydra's joblib launcher (sweep=gpus) runs jobs one after another in one worker process: when
    ``run_job`` returns, its module, Trainer and optimizer are gone (not kept by a reference cycle
    until some later collection, nor by the game engine's last parse), so that the GPU memory they
    held can be given back."""
    import weakref

    from textrl.cli.train import run_job
    from textrl.training.module import PPOModule

    refs = []
    fit_start = PPOModule.on_fit_start

    def recording(module):  # no callback: Lightning hands callbacks the module's log methods
        refs.extend([weakref.ref(module.trainer), weakref.ref(module), weakref.ref(module.policy)])
        fit_start(module)

    monkeypatch.setattr(PPOModule, "on_fit_start", recording)
    for job in ("a", "b"):
        refs.clear()
        result = run_job(config(tmp_path / job, "iterations=1", "eval.every=1", "eval.before_training=false"))
        assert result["metrics"] and "module" not in result
        assert len(refs) == 3 and [r() for r in refs] == [None] * 3
