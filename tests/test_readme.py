"""Every `python train.py ...` command of the READMEs and of docs/ composes and validates;
every function docs/gpu.md cites exists.

The command lines are read from the documents themselves: fenced code blocks (a line continued with
a backslash is one command) and inline code spans, in the forms `python train.py ARGS`,
`.venv/bin/python train.py ARGS` and `make train ARGS="..."`. Each is composed through Hydra with
textrl's config directory and turned into a validated, resolved `TrainConfig`, as `train.py` does
before it builds anything, so an example that stops composing or validating fails here, named by
its file and line. A `-m` (multirun) line is composed with the first value of each comma sweep
(`seed=1,2,3` -> `seed=1`). A literal `...` in a command stands for elided overrides and is
dropped. A command followed by an `error: ...` line (the README's bad-value example) must fail
with exactly that message.

Lines that need a GPU (`trainer=gpu`, `sweep=gpus`, `memory=fp16`, `memory=qlora`, `memory=lowmem`,
...) fail validation on a machine without CUDA. They are composed all the same, and only the CUDA
check is skipped: when validation refuses a line for the lack of a CUDA GPU, the line is validated
again with torch reporting a bf16-capable GPU, so every other check still runs.

A docs/results.md command that sets a key removed from textrl since (``REMOVED_KEYS``: options
tried and not adopted) ran at the commit it names and is not composed; every other key it sets must
still compose, so a typo still fails. An option renamed since (``RENAMED``) composes by its new name. A README command runs at head: it may set none of them.

`python bench/learn.py` lines of the README (not of docs/results.md, whose lines record what ran
at older commits) must name configurations that `bench/learn.py` has, and each configuration's
overrides plus the line's compose in the same way.

docs/gpu.md cites code as `textrl/file.py::function` (or `Class.method`), never by line number:
each cited name must still be defined in that file.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from textrl.config import CONF_DIR, register_configs, to_train_config
from textrl.errors import ConfigError

ROOT = CONF_DIR.parent
DOCUMENTS = ["README.md", "docs/results.md", "docs/configuration.md", "multirun/README.md"]
TRAIN = re.compile(r"(?:^|\s)(?:\S*/)?python3?\s+train\.py\b(.*)$")
MAKE = re.compile(r"(?:^|\s)make\s+train\s+(ARGS=.*)$")
LEARN = re.compile(r"(?:^|\s)(?:\S*/)?python3?\s+bench/learn\.py\b(.*)$")
FENCE = re.compile(r"^\s*```")
CUDA_MISSING = "needs a CUDA GPU"
# keys removed from textrl after docs/results.md recorded runs with them (options not adopted)
REMOVED_KEYS = {"ppo.value_steps_left", "ppo.explore_decay", "env.shaping", "env.repeat_penalty", "self_imitation.*",
                "ppo.value_warmup", "ppo.step_budget", "model.detach_value"}
# options renamed since a docs/results.md command ran (textrl.config.RENAMED_OPTIONS): composed by today's name
RENAMED = {"experiment=medium_rl_cpu": "experiment=medium_rl_rule_cpu"}


def _removed(override: str) -> bool:
    """Whether an override sets a key of ``REMOVED_KEYS`` (``group.*``: any key of that group)."""
    key = override.split("=", 1)[0].lstrip("+~")
    return any(key == k or (k.endswith(".*") and key.startswith(k[:-1])) for k in REMOVED_KEYS)


def _fenced_lines(text: str):
    """(line number, command line) of every line inside fenced code blocks, continuations joined,
    and the line that follows each (to find an expected `error:`)."""
    lines, inside, out = text.split("\n"), False, []
    i = 0
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            inside = not inside
            i += 1
            continue
        if inside:
            start, joined = i + 1, line
            while joined.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                joined = joined.rstrip()[:-1] + " " + lines[i].strip()
            following = lines[i + 1] if i + 1 < len(lines) else ""
            out.append((start, joined, following))
        i += 1
    return out


def _inline_spans(text: str):
    """(line number, content) of every inline code span outside fenced blocks; a span may wrap."""
    kept = []
    inside = False
    for line in text.split("\n"):
        if FENCE.match(line):
            inside = not inside
            kept.append("")
        else:
            kept.append("" if inside else line)
    prose = "\n".join(kept)
    return [(prose.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
            for m in re.finditer(r"`([^`]+)`", prose)]


def _split(args: str, comments: bool) -> list[str]:
    lexer = shlex.shlex(args, posix=True, punctuation_chars=False)
    lexer.whitespace_split = True
    lexer.commenters = "#" if comments else ""
    return list(lexer)


def _train_args(command: str, comments: bool) -> list[str] | None:
    """The tokens after `train.py` (or inside `make train ARGS="..."`), up to a shell operator."""
    command = command.strip().removeprefix("$ ")
    if m := MAKE.search(command):
        assignment = _split(m.group(1), comments)[0]
        return _split(assignment.removeprefix("ARGS="), comments=False)
    if m := TRAIN.search(command):
        tokens = []
        for token in _split(m.group(1), comments):
            if token in {"&&", "||", "|", ";", ">", "2>&1"}:
                break
            tokens.append(token)
        return tokens
    return None


def _top_level_comma_split(value: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in value:
        depth += (ch in "[{(") - (ch in "]})")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [*parts, current]


def _overrides(tokens: list[str]) -> list[str]:
    """Hydra overrides of one command: flags handled, a multirun's sweeps reduced to their first value."""
    multirun = any(t in {"-m", "--multirun"} for t in tokens)
    overrides, skip = [], False
    for token in tokens:
        if skip:
            skip = False
        elif token in {"-m", "--multirun"} or token == "...":
            continue
        elif token in {"--cfg", "-c", "--package", "-p"}:
            skip = True  # their argument follows
        elif token.startswith("-"):
            raise AssertionError(f"unexpected flag {token!r}: teach tests/test_readme.py what it means")
        else:
            if multirun and "=" in token:
                key, value = token.split("=", 1)
                token = f"{key}={_top_level_comma_split(value)[0]}"
            overrides.append(token)
    return overrides


def _commands():
    """(id, overrides, expected error or None) of every train.py command in the documents."""
    found = []
    for name in DOCUMENTS:
        text = (ROOT / name).read_text()
        for line_no, line, following in _fenced_lines(text):
            tokens = _train_args(line, comments=True)
            if tokens is not None:
                expected = following.strip()[len("error: "):] if following.strip().startswith("error: ") else None
                found.append((f"{name}:{line_no}: {line.strip()[:100]}", tokens, expected))
        for line_no, span in _inline_spans(text):
            tokens = _train_args(span, comments=False)
            if tokens is not None:
                found.append((f"{name}:{line_no}: `{span[:100]}`", tokens, None))
    return found


COMMANDS = _commands()


def _compose(overrides: list[str], tmp_path):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"output_dir={tmp_path}", *overrides])
    return to_train_config(cfg)


def _compose_as_on_a_gpu(overrides: list[str], tmp_path, monkeypatch):
    """The same, with torch reporting one bf16-capable CUDA device: only the CUDA check is skipped."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (8, 0))  # native bf16
    return _compose(overrides, tmp_path)


def test_the_documents_hold_train_commands():
    # a sanity check on the extraction itself: the README's own examples are found
    ids = [c[0] for c in COMMANDS]
    assert sum(i.startswith("README.md") for i in ids) >= 20
    assert any("-m sweep=cpu" in i for i in ids)
    assert any("make train ARGS=" in i for i in ids)
    assert any(expected for _, _, expected in COMMANDS)


@pytest.mark.parametrize("where, tokens, expected", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_documented_train_command_composes(where, tokens, expected, tmp_path, monkeypatch):
    overrides = _overrides(tokens)
    removed = [o for o in overrides if _removed(o)]
    if removed:  # a historical command: the rest of what it sets must still compose
        assert where.startswith("docs/results.md:"), f"{where} sets {removed}: removed from textrl"
        overrides = [o for o in overrides if not _removed(o)]
    if where.startswith("docs/results.md:"):
        overrides = [RENAMED.get(o, o) for o in overrides]
    if expected is not None:  # the document shows this command failing, with this message
        with pytest.raises(ConfigError) as err:
            _compose(overrides, tmp_path)
        assert str(err.value) == expected
        return
    try:
        _compose(overrides, tmp_path)
    except ConfigError as exc:
        if CUDA_MISSING not in str(exc) or torch.cuda.is_available():
            raise
        _compose_as_on_a_gpu(overrides, tmp_path, monkeypatch)


def test_only_the_removed_keys_are_left_out_of_a_historical_command():
    assert _removed("ppo.value_steps_left=true") and _removed("self_imitation.episodes=16")
    assert _removed("env.shaping=0.2") and _removed("+env.repeat_penalty=0.2") and _removed("model.detach_value=false")
    # a misspelt key is not removed: it is composed, and fails
    assert not _removed("ppo.value_step_left=true") and not _removed("ppo.explore=0.3")
    assert not _removed("env.shaping_x=1") and not _removed("self_imitationx.episodes=1")


def _learn_configs() -> dict[str, list[str]]:
    """bench/learn.py's CONFIGS, read without importing the script."""
    tree = ast.parse((ROOT / "bench" / "learn.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CONFIGS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("bench/learn.py has no CONFIGS")


def _learn_commands():
    text = (ROOT / "README.md").read_text()
    lines = [(n, line) for n, line, _ in _fenced_lines(text)] + _inline_spans(text)
    return [(f"README.md:{n}: {line.strip()[:100]}", m.group(1)) for n, line in lines if (m := LEARN.search(line))]


LEARN_COMMANDS = _learn_commands()


@pytest.mark.parametrize("where, args", LEARN_COMMANDS, ids=[c[0] for c in LEARN_COMMANDS])
def test_every_bench_learn_command_of_the_readme_runs_at_head(where, args, tmp_path):
    tokens = _split(args, comments=True)
    extra = tokens[tokens.index("--") + 1:] if "--" in tokens else []
    head = tokens[:tokens.index("--")] if "--" in tokens else tokens
    configs = []
    if "--configs" in head:
        for token in head[head.index("--configs") + 1:]:
            if token.startswith("--"):
                break
            configs.append(token)
    known = _learn_configs()
    for name in configs or ["default"]:
        assert name in known, f"bench/learn.py has no configuration {name!r} (it has {sorted(known)})"
        _compose([*known[name], *extra, "seed=1"], tmp_path)


def _defines(path: Path, dotted: str) -> bool:
    """Whether the module at ``path`` defines ``dotted`` (a function, class, ``Class.method`` or a
    module-level name)."""
    def names(node) -> set[str]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return {node.name}
        if isinstance(node, ast.Assign):
            return {getattr(t, "id", None) for t in node.targets}
        if isinstance(node, ast.AnnAssign):
            return {getattr(node.target, "id", None)}
        return set()

    scope = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        found = next((node for node in scope if part in names(node)), None)
        if found is None:
            return False
        scope = getattr(found, "body", [])
    return True


GPU_CITES = sorted(set(re.findall(r"`(textrl/[\w/]+\.py)::([\w.]+)`", (ROOT / "docs" / "gpu.md").read_text())))


@pytest.mark.parametrize("path, name", GPU_CITES, ids=[f"{p}::{n}" for p, n in GPU_CITES])
def test_docs_gpu_cites_functions_that_exist(path, name):
    # docs/gpu.md names code as file.py::function (never line numbers): each must still be there
    assert (ROOT / path).is_file(), f"docs/gpu.md cites {path}, which does not exist"
    assert _defines(ROOT / path, name), f"docs/gpu.md cites {path}::{name}, which {path} does not define"


@pytest.mark.parametrize("document", ["README.md", "docs/gpu.md"])
def test_every_test_the_readme_cites_exists(document):
    """The README's tables name the tests that pin its promises, and docs/gpu.md the CPU test that
    stands in for each GPU line (`tests/file.py::test_name`, or `::test_name` after a file in the
    same line): each must exist, so a renamed test fails here."""
    cited = []
    for line in (ROOT / document).read_text().splitlines():
        current = None
        for path, name in re.findall(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`", line):
            current = path or current
            if current:
                cited.append((current, name))
    assert len(cited) >= 20
    for path, name in cited:
        assert (ROOT / path).is_file(), path
        if name:
            assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"{path}::{name}"


def test_the_family_table_is_the_measured_one():
    """docs/results.md's table of game families is bench/families.py's output (families.md), row for
    row: a figure changed by hand, or a family measured and not copied in, fails here."""
    rows = [line for line in (ROOT / "bench/results/families/families.md").read_text().splitlines()
            if line.startswith("| `")]
    results = (ROOT / "docs/results.md").read_text()
    assert rows, "bench/results/families/families.md holds no family"
    assert [line for line in results.splitlines() if re.match(r"\| `tw\w+` \(\d+\) \|", line)] == rows


def test_the_readme_family_recipes_show_the_measured_figures():
    """Each family's row of the README's recipe table shows what bench/families.py measured for its
    trained policy (wins with their 95% interval, steps, minutes)."""
    readme = (ROOT / "README.md").read_text().splitlines()
    for line in (ROOT / "bench/results/families/families.md").read_text().splitlines():
        if not (m := re.match(r"\| `(\w+)` \(\d+\) \|", line)):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        wins, interval, steps = re.match(r"([\d.]+) (\[[^]]*\]) / ([\d.]+)", cells[3]).groups()
        row = next((r for r in readme if f"`python train.py experiment={m.group(1)}_cpu`" in r), None)
        assert row, f"the README has no recipe row for {m.group(1)}"
        row_cells = [c.strip() for c in row.strip("|").split("|")]
        assert f"{wins} {interval} in {steps} steps" in row_cells[3], (m.group(1), row_cells[3])
        assert row_cells[2].split()[0] == cells[4], (m.group(1), row_cells[2])
