import pytest

from textrl.games.env import GameFileError, InvalidCommandError, TextGame, drop_oldest, kept_answers
from textrl.config import load_env_config
from textrl.games.pool import GamePool


@pytest.mark.parametrize("difficulty", ["easy", "medium"])
def test_walkthrough_wins_with_expected_rewards(difficulty):
    spec = load_env_config(difficulty)
    for path in GamePool(difficulty).games("eval", 3):
        env = TextGame(path, spec.max_steps, step_penalty=0.1, win_bonus=1.0)
        obs = env.reset()
        assert obs.feedback == "" and obs.objective and obs.admissible_commands
        walkthrough = list(env.walkthrough)
        assert walkthrough, "TextWorld games carry their walkthrough"
        rewards = []
        for i, command in enumerate(walkthrough):
            before = env.observation.score
            result = env.step(command)
            gained = result.observation.score - before
            last = i == len(walkthrough) - 1
            assert result.reward == pytest.approx(gained + (1.0 if last else 0.0) - 0.1)
            assert result.terminated == last and not result.truncated
            rewards.append(result.reward)
        assert env.observation.won
        assert sum(rewards) == pytest.approx(env.observation.max_score + 1.0 - 0.1 * len(walkthrough))


def test_inadmissible_command_is_refused_and_never_sent(easy_games):
    env = TextGame(easy_games[0], 8)
    obs = env.reset()
    with pytest.raises(InvalidCommandError, match="not admissible") as err:
        env.step("dance wildly")
    assert "look" in str(err.value)  # the message lists what is admissible
    assert env.steps == 0 and env.observation is obs and not env.history


def test_step_limit_truncates_and_history_is_bounded(easy_games):
    env = TextGame(easy_games[1], max_steps=3, history_len=2)
    env.reset()
    results = [env.step("look") for _ in range(3)]
    assert [r.truncated for r in results] == [False, False, True]
    assert [r.reward for r in results] == pytest.approx([-0.1] * 3)
    assert not any(r.terminated for r in results)
    assert len(env.history) == 2 and env.history[-1].command == "look"
    with pytest.raises(RuntimeError, match="reset"):
        env.step("look")
    env.reset()
    assert env.steps == 0 and not env.history


def test_full_history_drops_its_oldest_half_at_once(easy_games):
    env = TextGame(easy_games[1], max_steps=8, history_len=4)
    env.reset()
    lengths = []
    for i in range(7):
        env.step(["look", "inventory"][i % 2])
        lengths.append(len(env.history))
    assert lengths == [1, 2, 3, 4, 3, 4, 3]
    assert [t.command for t in env.history] == ["look", "inventory", "look"]  # the newest turns stay


def test_a_history_cut_keeps_each_commands_latest_answer(easy_games):
    env = TextGame(easy_games[1], max_steps=12, history_len=4, keep_answers=["inventory"])
    env.reset()
    shown = []  # the commands the history's observations answer, after each step
    for command in ["inventory", "look", "look", "look", "look", "inventory", "look", "look"]:
        env.step(command)
        shown.append([t.answer_to for t in env.history])
    assert shown[3] == ["", "inventory", "look", "look"]
    # the fifth turn overflows: two turns go, the oldest ones but the inventory's answer
    assert shown[4] == ["inventory", "look", "look"]
    assert shown[5] == ["inventory", "look", "look", "look"]
    # a newer answer to "inventory" arrives: the older one is cut like any other turn
    assert shown[6] == ["look", "look", "inventory"]
    assert shown[7] == ["look", "look", "inventory", "look"]
    assert kept_answers(env.history, ["inventory"]) == {2} and kept_answers(env.history, ["read"]) == set()
    history = list(env.history)
    drop_oldest(history, 4, ["inventory"])  # a block of 4 takes the 3 others only
    assert history == [env.history[2]]
    drop_oldest(history, 4, ["inventory"])  # nothing else left: the kept turn goes too
    assert history == []


def test_feedback_is_cleaned_of_prompt_and_status_lines(easy_games):
    env = TextGame(easy_games[2], 8)
    env.reset()
    feedback = env.step("look").observation.feedback
    assert feedback.startswith("-= ") and ">" not in feedback and "/1" not in feedback.splitlines()[-1]


def test_missing_or_corrupt_game_file_fails_clearly(tmp_path, easy_games):
    with pytest.raises(GameFileError, match="does not exist"):
        TextGame(tmp_path / "nope.z8", 8)
    broken = tmp_path / "broken.z8"
    broken.write_bytes(b"not a z-machine story")
    with pytest.raises(GameFileError, match="truncated or corrupt"):
        TextGame(broken, 8)
    good = easy_games[0].read_bytes()
    truncated = tmp_path / "truncated.z8"
    truncated.write_bytes(good[: len(good) // 2])
    truncated.with_suffix(".json").write_bytes(easy_games[0].with_suffix(".json").read_bytes())
    with pytest.raises(GameFileError, match="truncated or corrupt"):
        TextGame(truncated, 8)
    no_json = tmp_path / "nojson.z8"
    no_json.write_bytes(good)
    with pytest.raises(GameFileError, match="json is missing or corrupt"):
        TextGame(no_json, 8)
