"""env.step_workers: games held and stepped by worker processes play exactly as in the training process."""

import multiprocessing as mp

import lightning as L
import pytest
import torch

from tests.conftest import config, read_metrics
from textrl.cli.train import train
from textrl.config import load_env_config
from textrl.games.env import InvalidCommandError, open_game
from textrl.games.workers import GameWorkers, step_games
from textrl.policy.decoding import ConstrainedDecoder
from textrl.rollout import Sampling, decode_episodes, episode_seeds


@pytest.fixture(scope="module")
def workers():
    w = GameWorkers(2)
    yield w
    w.close()


def steps_of(episodes):
    """What an episode played, exactly, and its numbers (log-probs, values, bootstrap value): rows
    decoded in other batches agree to ~1e-6 in fp32, not bitwise."""
    played = [[(s.action.command, s.reward, s.terminated, s.truncated, s.feedback, s.prompt_ids) for s in e.steps]
              + [e.won] for e in episodes]
    numbers = [x for e in episodes for s in e.steps for d in s.action.decisions for x in (d.logprob, d.value)]
    numbers += [e.bootstrap_value for e in episodes if e.bootstrap_value is not None]
    return played, numbers


def test_a_rollout_on_workers_or_in_groups_is_the_rollout_in_one_batch(tiny, prompts, easy_games, workers):
    policy, tokenizer = tiny
    env = load_env_config("easy")
    games = easy_games[:6]
    seeds = episode_seeds(1, 0, games)
    runs = []
    for envs, groups in (([open_game(g, env) for g in games], 1), (workers.open(games, env), 2),
                         ([open_game(g, env) for g in games], 4)):  # in process, four groups (env.decode_groups)
        # on workers: two groups, each with its decoder, one group stepping while the other decodes
        decoders = [ConstrainedDecoder(policy) for _ in range(groups)]
        with torch.no_grad():
            episodes, stats = decode_episodes(envs, decoders, prompts, Sampling(1.0, seeds), bootstrap=True)
        runs.append(steps_of(episodes))
        assert [e.game for e in episodes] == [str(g) for g in games]
        for g in envs:
            g.close()
    (played, numbers), *others = runs
    for played_g, numbers_g in others:
        assert played == played_g and numbers == pytest.approx(numbers_g, abs=1e-4)
    assert sum(len(e) - 1 for e in played) > len(games)  # several turns: histories and prompts grew
    assert len(numbers) > sum(len(e) - 1 for e in played)  # ... and bootstrap values of cut episodes


def test_workers_hold_their_share_of_the_games_and_refuse_bad_commands(easy_games, workers):
    env = load_env_config("easy")
    games = workers.open(easy_games[:3], env)
    assert [g.worker for g in games] == [0, 1, 0]
    for g in games:
        g.reset()
    assert all(g.observation.admissible_commands for g in games)
    with pytest.raises(InvalidCommandError, match="is not admissible here"):
        step_games(games, ["dance wildly"] * 3)
    local = open_game(easy_games[0], env)
    local.reset()
    command = local.observation.admissible_commands[0]
    assert games[0].step(command) == local.step(command) and games[0].history == local.history
    for g in games:
        g.close()


class SeeWorkers(L.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        self.processes = [m._process for m in pl_module.player.workers.managers]
        self.alive = [p.is_alive() for p in self.processes]


def test_decode_groups_gives_the_module_a_decoder_per_group(tmp_path):
    from textrl.training.module import PPOModule
    from textrl.policy.model import build_policy

    cfg = config(tmp_path, "env.decode_groups=3")
    module = PPOModule(cfg, *build_policy(cfg.model))
    assert len(module.player.decoders) == 3 and len({id(d) for d in module.player.decoders}) == 3
    # unset: four groups on a CPU (never more than the envs), one on a GPU (not testable here)
    assert config(tmp_path, "env.num_envs=16", "env.pool_size=16", "env.decode_groups=null").env.decode_groups == 4
    assert config(tmp_path, "env.num_envs=2", "env.decode_groups=null").env.decode_groups == 2


def test_training_with_step_workers_runs_and_ends_its_workers(tmp_path):
    before = set(mp.active_children())
    seen = SeeWorkers()
    result = train(config(tmp_path, "iterations=1", "env.step_workers=2"), callbacks=[seen])
    assert seen.alive == [True, True]  # the rollout ran on the two workers
    assert not any(p.is_alive() for p in seen.processes)
    assert result["module"].player.workers is None
    assert set(mp.active_children()) <= before  # the run's worker processes have ended
    rows = read_metrics(tmp_path)
    assert any(r.get("perf/rollout_env_s") for r in rows) and any(r.get("eval/win_rate") for r in rows)
