"""textrl-report: compare runs across seeds: a table (mean ± std) and learning-curve plots.

    textrl-report multirun/2026-11-22/10-00-00              # a Hydra sweep directory
    textrl-report outputs/2026-11-22/09-*  --out report/     # any set of run directories
    textrl-report outputs/2026-11-22/09-12-44                # a single run

A run is a directory with ``logs/metrics.csv`` (logger=csv) or TensorBoard event files in ``logs/``
(logger=tensorboard); no W&B account is needed. Runs are grouped by their Hydra overrides without
``seed=``, ``threads=``, ``sweep=`` and ``logger=`` (``textrl.training.loggers.configuration``, the
name W&B groups them by too): the seeds of one setting form one row of the table and one line (mean) with a band (± one standard deviation) in
the plots. Writes ``report.md``, ``report.json``, ``curves.png`` and ``report.html`` (one
self-contained page: the table, the curves and, with ``--attention DIR ...``, the objective-share
plots that ``textrl-attention`` wrote there) to ``--out`` (default ``<first dir>/report``).
"""

from __future__ import annotations

import argparse
import base64
import csv
import html
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from textrl.training.loggers import configuration

EVAL = ("eval/win_rate", "eval/episode_len")
ROLLOUT = ("rollout/win_rate", "rollout/episode_len")


class ReportError(ValueError):
    pass


@dataclass
class Run:
    path: Path
    group: str
    seed: str
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # metric -> [(iteration, value)]

    def final(self, metric: str) -> float:
        return self.curves[metric][-1][1]

    def best(self, metric: str) -> float:
        values = [v for _, v in self.curves[metric]]
        return max(values) if metric.endswith("win_rate") else min(values)


def find_runs(dirs: list[Path]) -> list[Path]:
    """Run directories under ``dirs`` (a directory that is itself a run counts too)."""
    found = []
    for d in dirs:
        if not d.is_dir():
            raise ReportError(f"{d} is not a directory; pass a sweep (multirun/...) or run (outputs/...) directory")
        logs = [p.parent for p in d.rglob("logs/metrics.csv")] + [p.parent for p in d.rglob("logs/events.out.tfevents.*")]
        found += sorted({p.parent for p in logs})
    if not found:
        raise ReportError(f"no runs under {', '.join(map(str, dirs))}: expected <run>/logs/metrics.csv or "
                          f"TensorBoard event files in <run>/logs/ (train with logger=csv or logger=tensorboard)")
    return sorted(set(found))


def read_csv(path: Path) -> dict[str, list[tuple[int, float]]]:
    curves: dict[str, dict[int, float]] = defaultdict(dict)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if not row.get("iteration"):
                continue
            iteration = int(float(row["iteration"]))
            for metric in EVAL + ROLLOUT:
                if row.get(metric):
                    curves[metric][iteration] = float(row[metric])  # a resumed run's later value wins
    return {m: sorted(points.items()) for m, points in curves.items()}


def read_tensorboard(logs: Path) -> dict[str, list[tuple[int, float]]]:
    # slow import: only runs logged with logger=tensorboard need it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logs), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    # Lightning logs against its step, and one step can hold two rows (the evaluation before
    # training and the first iteration both log at step 0). Every row also holds "iteration":
    # a point belongs to the "iteration" logged at its step at the nearest time (one log call).
    marks = defaultdict(list)
    for e in (events.Scalars("iteration") if "iteration" in tags else []):
        marks[e.step].append((e.wall_time, int(e.value)))

    def iteration_of(event) -> int:
        near = min(marks.get(event.step, []), key=lambda m: abs(m[0] - event.wall_time), default=None)
        return near[1] if near else event.step

    curves = {}
    for metric in EVAL + ROLLOUT:
        if metric in tags:
            points = {iteration_of(e): e.value for e in events.Scalars(metric)}
            curves[metric] = sorted(points.items())
    return curves


def read_run(path: Path) -> Run:
    overrides_file = path / ".hydra" / "overrides.yaml"
    overrides = (yaml.safe_load(overrides_file.read_text()) or []) if overrides_file.is_file() else []
    seed = next((o.split("=", 1)[1] for o in overrides if o.startswith("seed=")), None)
    if seed is None and (path / ".hydra" / "config.yaml").is_file():
        seed = str(yaml.safe_load((path / ".hydra" / "config.yaml").read_text()).get("seed"))
    group = configuration(overrides)  # as W&B groups the same runs
    csv_file = path / "logs" / "metrics.csv"
    curves = read_csv(csv_file) if csv_file.is_file() else read_tensorboard(path / "logs")
    missing = [m for m in EVAL if not curves.get(m)]
    if missing:
        raise ReportError(f"{path} has no {missing[0]} values yet: a run reports after its first evaluation "
                          f"(iteration 0, written when training starts)")
    return Run(path, group, seed or path.name, curves)


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(runs: list[Run]) -> dict[str, dict]:
    groups: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        groups[run.group].append(run)
    summary = {}
    for name, members in groups.items():
        row = {"seeds": [r.seed for r in members], "runs": [str(r.path) for r in members],
               "iterations": [r.curves["eval/win_rate"][-1][0] for r in members]}
        for metric in EVAL:
            short = metric.split("/")[1]
            for kind in ("final", "best"):
                values = [getattr(r, kind)(metric) for r in members]
                mean, std = mean_std(values)
                row[f"{kind}_{short}"] = {"mean": mean, "std": std, "values": values}
        summary[name] = row
    return summary


def curve_band(runs: list[Run], metric: str) -> tuple[list[int], list[float], list[float]]:
    """Mean and standard deviation across runs at every iteration that any run logged."""
    by_iteration: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        for iteration, value in run.curves.get(metric, []):
            by_iteration[iteration].append(value)
    xs = sorted(by_iteration)
    stats = [mean_std(by_iteration[x]) for x in xs]
    return xs, [m for m, _ in stats], [s for _, s in stats]


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib  # slow import: only the plot needs it

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    metrics = [m for m in EVAL + ROLLOUT if any(r.curves.get(m) for r in runs)]
    rows = (len(metrics) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(metrics):]:
        ax.set_visible(False)
    groups = sorted({r.group for r in runs})
    for ax, metric in zip(axes.flat, metrics):
        for group in groups:
            members = [r for r in runs if r.group == group]
            xs, mean, std = curve_band(members, metric)
            lo = [m - s for m, s in zip(mean, std)]
            hi = [m + s for m, s in zip(mean, std)]
            if metric.endswith("win_rate"):
                lo, hi = [max(v, 0.0) for v in lo], [min(v, 1.0) for v in hi]
            line, = ax.plot(xs, mean, marker="o" if metric in EVAL else None, markersize=3,
                            label=f"{group} (n={len(members)})")
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2)
        kind, name = metric.split("/")
        ax.set_title(f"{name.replace('_', ' ')} ({'greedy, held-out games' if kind == 'eval' else 'training rollouts'})")
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(summary: dict[str, dict]) -> str:
    lines = ["| runs | seeds | iterations | final win rate | best win rate | final episode len | best episode len |",
             "|---|---|---|---|---|---|---|"]
    for group, row in summary.items():
        cells = [f"{row[k]['mean']:.3f} ± {row[k]['std']:.3f}"
                 for k in ("final_win_rate", "best_win_rate", "final_episode_len", "best_episode_len")]
        iterations = sorted(set(row["iterations"]))
        lines.append(f"| `{group}` | {len(row['seeds'])} | {'/'.join(map(str, iterations))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_command(d: Path) -> str | None:
    """The ``python train.py`` command that produced a sweep (multirun.yaml) or a run (.hydra/)."""
    multirun = d / "multirun.yaml"
    if multirun.is_file():
        overrides = yaml.safe_load(multirun.read_text())["hydra"]["overrides"]
        extra = [o for o in overrides.get("hydra", []) if o != "hydra.mode=MULTIRUN"]
        return " ".join(["python train.py -m", *overrides.get("task", []), *extra])
    single = d / ".hydra" / "overrides.yaml"
    if single.is_file():
        return " ".join(["python train.py", *(yaml.safe_load(single.read_text()) or [])])
    return None


def _png(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def html_page(summary: dict[str, dict], out: Path, produced_by: list[str], command: str | None,
              attention: list[Path]) -> str:
    """One page with everything inlined (images as data URIs): open it anywhere, mail it, attach it."""
    esc = html.escape
    rows = []
    for group, row in summary.items():
        cells = "".join(f"<td>{row[k]['mean']:.3f} ± {row[k]['std']:.3f}</td>"
                        for k in ("final_win_rate", "best_win_rate", "final_episode_len", "best_episode_len"))
        iterations = "/".join(map(str, sorted(set(row["iterations"]))))
        rows.append(f"<tr><td><code>{esc(group)}</code></td><td>{len(row['seeds'])}</td><td>{iterations}</td>{cells}</tr>")
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>textrl report</title><style>"
             "body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td:first-child{text-align:left}"
             "img{max-width:100%}pre{background:#f4f4f4;padding:8px;white-space:pre-wrap}</style></head><body>",
             "<h1>textrl report</h1><p>Greedy play on the held-out evaluation games; mean ± std across seeds.</p>",
             "<table><tr><th>runs</th><th>seeds</th><th>iterations</th><th>final win rate</th><th>best win rate</th>"
             "<th>final episode len</th><th>best episode len</th></tr>", *rows, "</table>",
             "<h2>Learning curves</h2>", f"<img alt='learning curves' src='{_png(out / 'curves.png')}'>"]
    for folder in attention:
        meta = json.loads((folder / "attention.json").read_text())
        parts += [f"<h2>Attention on the objective: {esc(meta['checkpoint'])} vs {esc(meta['base'])}</h2>",
                  f"<img alt='objective share per layer' src='{_png(folder / 'objective_share.png')}'>",
                  f"<pre>{esc(meta['command'])}</pre>"]
    if produced_by:
        parts += ["<h2>Runs produced by</h2>", *[f"<pre>{esc(c)}</pre>" for c in produced_by]]
    if command:
        parts += ["<h2>Report produced by</h2>", f"<pre>{esc(command)}</pre>"]
    return "\n".join(parts + ["</body></html>"]) + "\n"


def report(dirs: list[Path], out: Path, command: str | None = None, attention: list[Path] = ()) -> dict:
    for folder in attention:
        if not (folder / "attention.json").is_file():
            raise ReportError(f"--attention {folder}: no attention.json there (write it with textrl-attention --out {folder})")
    runs = [read_run(p) for p in find_runs(dirs)]
    summary = summarize(runs)
    out.mkdir(parents=True, exist_ok=True)
    plot(runs, out / "curves.png")
    produced_by = [c for c in (sweep_command(d) for d in dirs) if c]
    result = {"groups": summary, "curves": {str(r.path): r.curves for r in runs},
              "produced_by": produced_by, "command": command}
    (out / "report.json").write_text(json.dumps(result, indent=2) + "\n")
    md = ["# textrl report\n", f"{len(runs)} run(s) from {', '.join(map(str, dirs))}; mean ± std across seeds; "
          "win rate and episode length of greedy play on the held-out evaluation games.\n", table(summary), "",
          "![learning curves](curves.png)\n"]
    if produced_by:
        md += ["Runs produced by:\n", *[f"    {c}" for c in produced_by], ""]
    if command:
        md += ["Report produced by:\n", f"    {command}", ""]
    (out / "report.md").write_text("\n".join(md))
    (out / "report.html").write_text(html_page(summary, out, produced_by, command, list(attention)))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="textrl-report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path, help="sweep or run directories")
    ap.add_argument("--out", type=Path, help="where to write report.md, report.json, curves.png, report.html")
    ap.add_argument("--attention", type=Path, nargs="*", default=[],
                    help="textrl-attention output folders whose objective-share plot the HTML page shows")
    args = ap.parse_args(argv)
    out = args.out or args.dirs[0] / "report"
    command = " ".join(["textrl-report", *(argv if argv is not None else sys.argv[1:])])
    try:
        result = report(args.dirs, out, command, args.attention)
    except ReportError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(table(result["groups"]))
    print(f"\nwrote {out / 'report.md'}, {out / 'report.json'}, {out / 'curves.png'} and {out / 'report.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
