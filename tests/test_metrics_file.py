"""``metrics.csv`` is only ever rewritten whole (a temporary file, synced, renamed over it): a crash
while the csv logger rewrites it (on resume, or when new columns appear) keeps the previous file."""

from __future__ import annotations

import csv
import os

import pytest

from textrl.training.loggers import ResumableCSVLogger

ROWS = ["epoch,iteration,loss/policy,step", "0,0.0,0.5,0", "0,1.0,0.4,1", "1,2.0,0.3,2"]


class Crash(Exception):
    """The process dying in the middle of writing the file."""


def crash_after_one_row(monkeypatch):
    def writerows(self, rows):
        self.writerow(next(iter(rows)))
        raise Crash

    monkeypatch.setattr(csv.DictWriter, "writerows", writerows)


@pytest.fixture
def metrics(tmp_path):
    path = tmp_path / "logs" / "metrics.csv"
    path.parent.mkdir()
    path.write_text("\n".join(ROWS) + "\n")
    return path


def logger(tmp_path, resume_iteration=None):
    return ResumableCSVLogger(save_dir=tmp_path, name="", version="logs", resume_iteration=resume_iteration)


def test_a_crash_while_resuming_keeps_the_previous_metrics_file(tmp_path, metrics, monkeypatch):
    before = metrics.read_bytes()
    with monkeypatch.context() as patch:
        crash_after_one_row(patch)
        with pytest.raises(Crash):
            logger(tmp_path, resume_iteration=1).experiment
    assert metrics.read_bytes() == before
    assert sorted(p.name for p in metrics.parent.iterdir()) == ["metrics.csv"]

    logger(tmp_path, resume_iteration=1).experiment  # the resumed run that follows
    assert metrics.read_text().splitlines() == ROWS[:3]


def test_a_crash_while_adding_columns_keeps_the_previous_metrics_file(tmp_path, metrics, monkeypatch):
    log = logger(tmp_path)
    log.log_metrics({"epoch": 2, "iteration": 3.0, "loss/policy": 0.2}, step=3)  # written as it is logged
    before = metrics.read_bytes()
    assert before.decode().splitlines() == [*ROWS, "2,3.0,0.2,3"]
    with monkeypatch.context() as patch:
        crash_after_one_row(patch)
        with pytest.raises(Crash):
            log.log_metrics({"iteration": 3.0, "eval/win_rate": 0.5}, step=3)  # a new column: a rewrite
    assert metrics.read_bytes() == before


def test_the_rewrite_is_synced_before_it_is_renamed_over_the_file(tmp_path, metrics, monkeypatch):
    calls = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda src, dst: (calls.append(("replace", os.path.basename(dst))),
                                                         replace(src, dst))[1])
    logger(tmp_path, resume_iteration=2).experiment
    assert calls[:2] == ["fsync", ("replace", "metrics.csv")]
    assert metrics.read_text().splitlines() == ROWS
