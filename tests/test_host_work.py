"""Host work per rollout turn does not grow with the rows a batch decodes (issue 70 J; docs/gpu.md):
textrl's own instructions, counted by ``bench/host_work.py``, for each row added to a batch playing
the same games. A GPU decodes 64-256 rows in one batch, and any per-row step that walks
every row makes the host, not the device, set the speed there."""

import dataclasses
import sys

import pytest

from textrl.config import CONF_DIR, load_env_config

sys.path.insert(0, str(CONF_DIR.parent / "bench"))
from host_work import PACKAGE, Instructions, host_work  # noqa: E402  (bench/ is a script directory)


# the GPU layout runs eager FlexAttention on a CPU, which computes every row's scores over the whole
# buffer: a few GB at 16 rows, out of memory at 64
@pytest.mark.parametrize("batched,sizes", [(False, (4, 8, 32)), (True, (4, 8, 12))], ids=["cpu_layout", "gpu_layout"])
def test_each_row_added_adds_the_same_host_work(easy_pool, tiny, batched, sizes):
    """Copies of 4 games, each with its own game's seed, at three batch sizes: the same model calls
    at every size, so work linear in the rows adds exactly the same instructions for each row added;
    a step that walks all rows for each row (a row lookup by ``list.index``) adds more at 32 rows
    than at 8."""
    policy, tokenizer = tiny
    games = easy_pool.games("eval", 4)
    env = dataclasses.replace(load_env_config("easy"), max_steps=5)  # some episodes end sooner: rows leave
    runs = [host_work(policy, tokenizer, games, env, n, batched) for n in sizes]
    assert len(runs[0]["episode_lengths"]) > 1 and len({r["model_calls"] for r in runs}) == 1, runs
    added = [(b["instructions"] - a["instructions"]) / (b["rows"] - a["rows"]) for a, b in zip(runs, runs[1:])]
    assert added[1] == pytest.approx(added[0], rel=1e-6), (added, runs)


def _textrl_code(source: str):
    """``source``'s function ``f``, compiled under a file name in textrl's package: the counter's own."""
    namespace: dict = {}
    exec(compile(source, PACKAGE + "/counted.py", "exec"), namespace)
    return namespace["f"]


def test_the_counter_sees_loops_and_list_scans_in_textrl_code_only():
    """The instrument itself: a loop in textrl's code counts each iteration's instructions, a
    ``list.index`` there the list's length; code outside textrl counts nothing."""
    loop = _textrl_code("def f(rows):\n    return [r + 1 for r in rows]\n")
    lookups = _textrl_code("def f(rows):\n    return [rows.index(r) for r in rows]\n")
    with Instructions() as short:
        loop(list(range(10)))
    with Instructions() as long:
        loop(list(range(1000)))
    assert 10 < short.count and 50 * short.count < long.count
    with Instructions() as scans:
        lookups(list(range(100)))
    assert scans.count >= 100 * 100  # each lookup walks the list
    with Instructions() as outside:
        [r for r in range(100)].index(99)  # this file is not textrl's
    assert outside.count == 0
