"""textrl-report on a real Hydra sweep that the test runs itself (2 seeds x 2 iterations, tiny model),
its two jobs side by side on this machine's cores (sweep=cpu: Hydra's joblib launcher)."""

import csv
import json
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from textrl.cli.report import main
from tests.conftest import SMALL

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    cmd = [sys.executable, "train.py", "-m", "sweep=cpu", "seed=1,2", "iterations=2", "eval.every=1", *SMALL,
           f"hydra.sweep.dir={out}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def final_eval(run: Path, metric: str) -> float:
    with open(run / "logs" / "metrics.csv") as f:
        return [float(r[metric]) for r in csv.DictReader(f) if r.get(metric)][-1]


def test_sweep_cpu_runs_the_jobs_side_by_side_each_on_its_own_core(sweep):
    runs = sorted(sweep.glob("*_seed*"))
    assert len(runs) == 2
    spans, slots = [], []
    for run in runs:
        log = (run / "train.log").read_text()
        claimed = re.search(r"trainer.share_machine: cores \[(\d+)\] \(slot (\d) of (\d+)\)", log)
        assert claimed, log[-2000:]
        slots.append(int(claimed.group(2)))
        times = [datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f") for t in re.findall(r"^\[([\d\- :,]+)\]", log, re.M)]
        spans.append((min(times), max(times)))
        assert (run / "checkpoints" / "last.ckpt").is_file()
    if int(claimed.group(3)) >= 2:  # a machine with 2+ cores: two jobs at once, on different cores
        assert sorted(slots) == [0, 1]
        (a0, a1), (b0, b1) = spans
        assert a0 < b1 and b0 < a1, spans  # each started before the other ended


def test_report_on_a_sweep_writes_table_json_and_png(sweep, tmp_path, capsys):
    assert main([str(sweep), "--out", str(tmp_path)]) == 0
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    result = json.loads((tmp_path / "report.json").read_text())
    (group, row), = result["groups"].items()  # both seeds form one group: only the seed differs
    assert sorted(row["seeds"]) == ["1", "2"] and row["iterations"] == [2, 2]
    runs = sorted(sweep.glob("*_seed*"))
    finals = [final_eval(r, "eval/win_rate") for r in runs]
    assert sorted(row["final_win_rate"]["values"]) == sorted(finals)
    assert row["final_win_rate"]["mean"] == pytest.approx(sum(finals) / 2)
    lens = [final_eval(r, "eval/episode_len") for r in runs]
    assert row["final_episode_len"]["mean"] == pytest.approx(sum(lens) / 2)
    assert row["best_episode_len"]["mean"] <= row["final_episode_len"]["mean"] + 1e-9
    assert "seed=1,2" in result["produced_by"][0] and result["produced_by"][0].startswith("python train.py -m")
    md = (tmp_path / "report.md").read_text()
    assert f"| `{group}` | 2 | 2 |" in md and "![learning curves](curves.png)" in md
    assert f"| `{group}` | 2 | 2 |" in capsys.readouterr().out


def test_report_on_a_single_run(sweep, tmp_path):
    run = sorted(sweep.glob("*_seed*"))[0]
    assert main([str(run), "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "report.json").read_text())
    (row,) = result["groups"].values()
    assert row["seeds"] == ["1"] and row["final_win_rate"]["std"] == 0.0
    assert row["final_win_rate"]["mean"] == final_eval(run, "eval/win_rate")
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_runs_that_differ_only_in_threads_are_one_group(sweep, tmp_path):
    """threads=N changes speed, not learning (bench/learn.py runs seeds side by side at threads=1)."""
    import shutil

    import yaml

    runs = sorted(sweep.glob("*_seed*"))
    for k, run in enumerate(runs):
        shutil.copytree(run, tmp_path / "runs" / run.name)
    second = tmp_path / "runs" / runs[1].name / ".hydra" / "overrides.yaml"
    second.write_text(yaml.safe_dump(yaml.safe_load(second.read_text()) + ["threads=1"]))
    assert main([str(tmp_path / "runs"), "--out", str(tmp_path / "report")]) == 0
    (row,) = json.loads((tmp_path / "report" / "report.json").read_text())["groups"].values()
    assert sorted(row["seeds"]) == ["1", "2"]


def test_report_on_a_directory_without_runs_says_what_it_expected(tmp_path):
    with pytest.raises(SystemExit, match="no runs under .*logs/metrics.csv"):
        main([str(tmp_path)])


def test_report_reads_tensorboard_logs_like_csv(tmp_path):
    """The same run logged with logger=tensorboard reports the same eval curve as its csv twin."""
    import textrl.cli.train as cli
    from tests.conftest import config

    for logger in ("csv", "tensorboard"):
        cli.train(config(tmp_path / logger, f"logger={logger}", "iterations=2", "eval.every=1"))
    assert list((tmp_path / "tensorboard" / "logs").glob("events.out.tfevents.*"))
    curves = {}
    for logger in ("csv", "tensorboard"):
        assert main([str(tmp_path / logger), "--out", str(tmp_path / f"report_{logger}")]) == 0
        (curves[logger],) = json.loads((tmp_path / f"report_{logger}" / "report.json").read_text())["curves"].values()
    for metric in ("eval/win_rate", "eval/episode_len", "rollout/win_rate"):
        assert [i for i, _ in curves["tensorboard"][metric]] == [i for i, _ in curves["csv"][metric]]
        assert [v for _, v in curves["tensorboard"][metric]] == pytest.approx([v for _, v in curves["csv"][metric]])
    assert [i for i, _ in curves["csv"]["eval/win_rate"]] == [0, 1, 2]


def test_report_html_is_one_self_contained_page_with_the_attention_plot(sweep, tmp_path):
    from textrl.cli.attention import main as attention

    run = sorted(sweep.glob("*_seed*"))[0]
    assert attention(["--checkpoint", str(run / "checkpoints" / "last.ckpt"), "--out", str(tmp_path / "att")]) == 0
    assert main([str(sweep), "--out", str(tmp_path / "r"), "--attention", str(tmp_path / "att")]) == 0
    page = (tmp_path / "r" / "report.html").read_text()
    result = json.loads((tmp_path / "r" / "report.json").read_text())
    (group, row), = result["groups"].items()
    assert f"<code>{group}</code></td><td>2</td>" in page
    assert f"{row['final_win_rate']['mean']:.3f} ± {row['final_win_rate']['std']:.3f}" in page
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(images) == 2  # the curves and the attention share, inlined: nothing else to ship
    import base64

    assert base64.b64decode(images[0]) == (tmp_path / "r" / "curves.png").read_bytes()
    assert base64.b64decode(images[1]) == (tmp_path / "att" / "objective_share.png").read_bytes()
    assert "src='http" not in page and "href=" not in page
    with pytest.raises(SystemExit, match="no attention.json there"):
        main([str(sweep), "--out", str(tmp_path / "r2"), "--attention", str(tmp_path)])


def test_wandb_groups_the_seeds_of_a_configuration_as_the_report_does(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from textrl.config import CONF_DIR, to_train_config
    from textrl.training.loggers import configuration, make_logger

    overrides = ["ppo.kl_coef=0.05", "seed=3", "threads=1", "logger=wandb"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        job = compose("train", overrides=overrides, return_hydra_config=True)  # what a Hydra job sees
        cfg = to_train_config(compose("train", overrides=[*overrides, f"output_dir={tmp_path}"]))
    HydraConfig.instance().set_config(job)
    try:
        logger = make_logger(cfg, tmp_path, None)
    finally:
        HydraConfig.instance().cfg = None
    assert logger._wandb_init["group"] == configuration(overrides) == "ppo.kl_coef=0.05"
