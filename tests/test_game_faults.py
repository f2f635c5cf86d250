"""A game fault costs its episode, not the rollout or the run (issue 30): a game whose engine raises
at its k-th step, answers too late or never, a step worker killed mid-rollout, a Java engine killed
or stopped mid-episode, a game that offers no command. Each aborted episode is marked and logged
with its game and the engine's traceback, and every other episode plays exactly as without the
fault. Real games and the real tiny model; faults are injected into a real game's engine step
(``tests/faulty_games.py``), in this process or inside its step worker."""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace

import lightning as L
import pytest
import torch

from tests.conftest import config, read_metrics
from tests.faulty_games import FaultyHost, inject
from textrl.cli.train import train
from textrl.config import load_env_config
from textrl.errors import ConfigError, GameFaultError
from textrl.games import express
from textrl.games.env import TextGame, open_game
from textrl.games.express import java_available, running
from textrl.games.pool import GamePool, GameSpec
from textrl.games.workers import GameWorkers
from textrl.policy.decoding import ConstrainedDecoder
from textrl.rollout import Sampling, decode_episodes, episode_seeds, play_uniform

K = 2  # the step the fault strikes at


def rollout(envs, policy, prompts, seeds):
    """One sampled episode per game, in two groups (as with step workers); the games closed after."""
    decoders = [ConstrainedDecoder(policy) for _ in range(2)]
    try:
        with torch.no_grad():
            return decode_episodes(envs, decoders, prompts, Sampling(1.0, seeds), bootstrap=True)[0]
    finally:
        for e in envs:
            e.close()


def played(episode):
    return [(s.action.command, s.reward, s.terminated, s.truncated, s.feedback) for s in episode.steps], episode.won


def target(base, rows):
    """The first of ``rows`` whose episode, without the fault, reaches step K."""
    return next(i for i in rows if base[i].length >= K)


def assert_others_as_before(episodes, base, skip):
    """Every episode but those in ``skip`` completed and played exactly as without the fault."""
    for i, (e, b) in enumerate(zip(episodes, base)):
        if i not in skip:
            assert e.aborted is None and played(e) == played(b), i


class Case:
    def __init__(self, env, games, tiny, prompts):
        self.env, self.games, self.policy, self.prompts = env, games, tiny[0], prompts
        self.seeds = episode_seeds(3, 0, games)
        self.base = self.play([open_game(g, env) for g in games])  # without any fault

    def play(self, envs):
        return rollout(envs, self.policy, self.prompts, self.seeds)

    def local(self):
        return [open_game(g, self.env) for g in self.games]


@pytest.fixture(scope="module")
def easy(tiny, prompts, easy_games):
    return Case(replace(load_env_config("easy"), max_steps=4, step_timeout=1.0), easy_games[:4], tiny, prompts)


@pytest.fixture(scope="module")
def workers():
    w = GameWorkers(2, host=FaultyHost)
    yield w
    w.close()


@pytest.mark.parametrize("fault, reason", [
    ("engine_raises", rf"step {K} \('.+'\) raised RuntimeError: the engine of .+ broke"),
    # in the training process the call is interrupted at the deadline, whether it would answer late or never
    ("answers_late", rf"step {K} \('.+'\) gave no answer within env.step_timeout=1 s"),
    ("never_answers", rf"step {K} \('.+'\) gave no answer within env.step_timeout=1 s"),
])
def test_a_game_that_raises_or_answers_late_costs_its_episode_only(fault, reason, easy, caplog):
    envs = easy.local()
    t = target(easy.base, range(len(envs)))
    inject(envs[t], K, fault)
    start = time.perf_counter()
    episodes = easy.play(envs)
    assert time.perf_counter() - start < 30  # never_answers sleeps an hour
    assert re.fullmatch(reason, episodes[t].aborted)
    assert played(episodes[t])[0] == played(easy.base[t])[0][: K - 1]  # its steps before the fault are kept
    assert_others_as_before(episodes, easy.base, {t})
    assert f"episode of {easy.games[t]} aborted" in caplog.text
    if fault == "engine_raises":  # the engine's own traceback
        assert "Traceback" in caplog.text and "in engine_raises" in caplog.text


def test_a_game_that_raises_on_a_step_worker_costs_its_episode_only(easy, workers, caplog):
    envs = workers.open(easy.games, easy.env)
    t = target(easy.base, range(len(envs)))
    workers.hosts[envs[t].worker].inject(envs[t].key, K, "engine_raises")
    generations = list(workers.generation)
    episodes = easy.play(envs)
    assert re.fullmatch(rf"step {K} \('.+'\) raised RuntimeError: the engine of .+ broke", episodes[t].aborted)
    assert_others_as_before(episodes, easy.base, {t})  # its worker's other games' answers were kept
    assert workers.generation == generations  # the worker itself is fine
    # the worker's traceback, in this process's log
    assert f"episode of {easy.games[t]} aborted" in caplog.text and "faulty_games.py" in caplog.text
    assert "in engine_raises" in caplog.text


@pytest.mark.parametrize("fault, how", [("worker_dies", r"died \(exit code -9\)"),
                                        ("never_answers", r"gave no answer within \d s \(env.step_timeout per game "
                                                          r"of the call\)")])
def test_a_step_worker_that_dies_or_hangs_is_replaced(fault, how, easy, workers, caplog):
    envs = workers.open(easy.games, easy.env)
    t = target(easy.base, range(len(envs)))
    w = envs[t].worker
    before = workers.generation[w]
    workers.hosts[w].inject(envs[t].key, K, fault)
    start = time.perf_counter()
    episodes = easy.play(envs)
    assert time.perf_counter() - start < 30
    assert re.fullmatch(rf"its step worker {w} {how}", episodes[t].aborted)
    # its other games died with it, unless they had finished; the other worker's played on
    lost = {i for i, g in enumerate(envs) if g.worker == w and episodes[i].aborted}
    assert t in lost and all(re.fullmatch(rf"its step worker {w} {how}", episodes[i].aborted) for i in lost)
    assert_others_as_before(episodes, easy.base, lost)
    assert re.search(rf"step worker {w} \(pid \d+\) {how}: replaced by a new process", caplog.text)
    assert workers.generation[w] == before + 1 and workers.managers[w]._process.is_alive()
    again = easy.play(workers.open(easy.games, easy.env))  # the next rollout plays on the new process
    assert_others_as_before(again, easy.base, set())


def test_a_game_that_offers_no_command_ends_its_episode(easy, caplog):
    envs = easy.local()
    r = len(envs) - 1  # one that offers none at its start: it cannot be played
    t = target(easy.base, range(r))
    inject(envs[t], K, "no_commands")
    reset = envs[r]._reset
    envs[r]._reset = lambda: (lambda obs, walkthrough: (replace(obs, admissible_commands=[]), walkthrough))(*reset())
    episodes = easy.play(envs)
    assert episodes[t].aborted is None and not episodes[t].won and episodes[t].steps[-1].terminated
    assert [c for c, *_ in played(episodes[t])[0]] == [c for c, *_ in played(easy.base[t])[0][:K]]
    assert f"{easy.games[t]} offers no admissible command after" in caplog.text
    assert episodes[r].aborted == "it offers no admissible command at its start" and not episodes[r].steps
    assert_others_as_before(episodes, easy.base, {r, t})
    # the random baseline: the same
    uniform = play_uniform(easy.local())[0]
    envs = easy.local()
    u = target(uniform, range(len(envs)))
    inject(envs[u], K, "no_commands")
    faulted = play_uniform(envs)[0]
    for e in envs:
        e.close()
    assert faulted[u].length == K and faulted[u].steps[-1].terminated and faulted[u].aborted is None
    assert [played(e) for i, e in enumerate(faulted) if i != u] == [played(e) for i, e in enumerate(uniform) if i != u]


needs_java = pytest.mark.skipif(not java_available(), reason=express.JAVA_MISSING)


@pytest.fixture(scope="module")
def twx(tiny, prompts):
    env = replace(load_env_config("twx_coin"), max_steps=5, step_timeout=2.0)
    return Case(env, GamePool(GameSpec.from_env(env)).games("eval", 3), tiny, prompts)


@needs_java
@pytest.mark.parametrize("fault", ["engine_dies", "engine_stops"])
def test_a_java_engine_that_dies_or_stops_costs_its_episode_and_is_never_reused(fault, twx, caplog):
    envs = twx.local()
    t = target(twx.base, range(len(envs)))
    engine = envs[t]._env
    inject(envs[t], K, fault)
    start = time.perf_counter()
    episodes = twx.play(envs)  # closing the games gives their engines back
    assert time.perf_counter() - start < 30
    assert re.match(rf"step {K} \('.+'\) raised Py4J", episodes[t].aborted)
    assert_others_as_before(episodes, twx.base, {t})
    assert f"episode of {twx.games[t]} aborted" in caplog.text
    assert not running(engine) and engine not in express._idle  # shut down, not put back
    assert express._idle and all(running(e) for e in express._idle)
    assert_others_as_before(twx.play(twx.local()), twx.base, set())  # the next games play on sound engines


@needs_java
def test_idle_java_engines_are_bounded(twx, monkeypatch):
    monkeypatch.setattr(express, "IDLE_ENGINES", 1)
    games = twx.local() + twx.local()
    engines = [g._env for g in games]
    for g in games:
        g.close()
    assert len(express._idle) == 1
    assert all(running(e) == (e in express._idle) for e in engines)  # the others were shut down


class OneFaultEach(L.Callback):
    """Arms a fault for the first game step of every training rollout and every evaluation."""

    armed = False

    def on_train_epoch_start(self, trainer, pl_module):
        self.armed = True

    def on_validation_epoch_start(self, trainer, pl_module):
        self.armed = True


def fault_when_armed(monkeypatch, arm: OneFaultEach) -> None:
    step = TextGame._step

    def faulty(game, command):
        if arm.armed:
            arm.armed = False
            raise RuntimeError("the engine broke")
        return step(game, command)

    monkeypatch.setattr(TextGame, "_step", faulty)


def test_training_leaves_aborted_episodes_out_counts_them_and_stops_when_too_many(tmp_path, monkeypatch):
    arm = OneFaultEach()
    fault_when_armed(monkeypatch, arm)
    fast = ["iterations=1", "env.max_steps=4", "eval.before_training=false"]
    train(config(tmp_path / "run", *fast), callbacks=[arm])
    rows = read_metrics(tmp_path / "run")
    train_rows = [r for r in rows if r.get("rollout/aborted")]
    eval_rows = [r for r in rows if r.get("eval/aborted")]
    assert [(float(r["rollout/aborted"]), float(r["rollout/episodes"])) for r in train_rows] == [(1.0, 3.0)]
    assert [(float(r["eval/aborted"]), float(r["eval/games"])) for r in eval_rows] == [(1.0, 3.0)]
    # the evaluation file counts the faulted game apart, with its reason, not as a game lost
    written = json.loads((tmp_path / "run" / "evaluation" / "iter_0001.json").read_text())
    assert written["games"] == 3 and len(written["per_game"]) == 3
    assert [a["reason"] for a in written["aborted"]] and "the engine broke" in written["aborted"][0]["reason"]
    arm = OneFaultEach()
    fault_when_armed(monkeypatch, arm)
    with pytest.raises(GameFaultError, match=r"1 of 4 training episodes were aborted by game faults, more than "
                                             r"env.max_aborted=0.2"):
        train(config(tmp_path / "stop", *fast, "env.max_aborted=0.2"), callbacks=[arm])


@pytest.mark.parametrize("override, rule", [("env.step_timeout=0.0", "a number of seconds > 0"),
                                            ("env.max_aborted=1.0", "a share in [0, 1)")])
def test_fault_settings_are_checked(tmp_path, override, rule):
    with pytest.raises(ConfigError, match=re.escape(f"{override} is not allowed: {rule}")):
        config(tmp_path, override)
