"""Host work per rollout turn does not grow with the rows a batch decodes (issue 70 J; docs/gpu.md):
textrl's own instructions, scans and consumed elements, counted by ``bench/host_work.py``, for each
row added to a batch playing the same games. A GPU decodes 64-256 rows in one batch, and any per-row
step that walks every row makes the host, not the device, set the speed there."""

import dataclasses
import sys

import pytest

from textrl.config import CONF_DIR, load_env_config

sys.path.insert(0, str(CONF_DIR.parent / "bench"))
from host_work import PACKAGE, HostWork, host_work  # noqa: E402  (bench/ is a script directory)


# fewer rows for the GPU layout: on a CPU it runs eager FlexAttention (bench/host_work.py --batched-rows)
@pytest.mark.parametrize("batched,sizes", [(False, (4, 8, 32)), (True, (4, 8, 12))], ids=["cpu_layout", "gpu_layout"])
def test_each_row_added_adds_the_same_host_work(easy_pool, tiny, batched, sizes):
    """Copies of 4 games, each on its game's seed, at three batch sizes: the same plays and model
    calls at every size, so work linear in the rows adds exactly the same count for each row added;
    a step that walks all rows for each row (a row lookup by ``list.index``, a cache start summed
    over the rows before it) adds more at 32 rows than at 8."""
    policy, tokenizer = tiny
    if next(policy.parameters()).device.type != "cpu":
        pytest.skip("counts the CPU's path: on CUDA the GPU layout's attention is compiled")
    games = easy_pool.games("eval", 4)
    env = dataclasses.replace(load_env_config("easy"), max_steps=5)  # some episodes end sooner: rows leave
    runs = [host_work(policy, tokenizer, games, env, n, batched) for n in sizes]
    assert len(runs[0]["episode_lengths"]) > 1, runs[0]
    # every size played the same games the same way: a difference in counts is the rows' own
    assert all(r["plays"] == runs[0]["plays"] and r["model_calls"] == runs[0]["model_calls"] for r in runs), runs
    added = [(b["instructions"] - a["instructions"]) / (b["rows"] - a["rows"]) for a, b in zip(runs, runs[1:])]
    assert added[1] == pytest.approx(added[0], rel=1e-6), (added, runs)


def _textrl_code(source: str):
    """``source``'s function ``f``, compiled under a file name in textrl's package: the counter's own."""
    namespace: dict = {}
    exec(compile(source, PACKAGE + "counted.py", "exec"), namespace)
    return namespace["f"]


def test_the_counter_sees_loops_scans_and_sums_in_textrl_code_only():
    """The instrument itself: a loop in textrl's code counts each iteration's instructions, a
    ``list.index`` there the list's length, a ``sum`` in a textrl module what it adds up; code
    outside textrl counts nothing."""
    from textrl.policy.speed import ragged_cache  # a textrl module: its globals get the counting sum

    loop = _textrl_code("def f(rows):\n    return [r + 1 for r in rows]\n")
    lookups = _textrl_code("def f(rows):\n    return [rows.index(r) for r in rows]\n")
    with HostWork() as short:
        loop(list(range(10)))
    with HostWork() as long:
        loop(list(range(1000)))
    assert 10 < short.count and 50 * short.count < long.count
    with HostWork() as scans:
        lookups(list(range(100)))
    assert scans.count >= 100 * 100  # each lookup walks the list
    with HostWork() as summed:
        ragged_cache.sum(range(500))
    assert summed.count >= 500 and "sum" not in vars(ragged_cache)  # counted inside, gone after
    with HostWork() as outside:
        [r for r in range(100)].index(99), sum(range(100))  # this file is not textrl's
    assert outside.count == 0
