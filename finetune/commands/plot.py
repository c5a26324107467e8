"""`zerotune plot`: loss and eval loss, learning rate, tokens/s and memory over steps, from runs' metrics.jsonl.

    zerotune plot runs/a runs/b --out curves.png

Several runs are overlaid, one colour each, the legend naming their folders. The PNG's `Source` text chunk lists
the runs and how many points of each series were drawn, so a picture can be traced back to its metrics files.
`plot_throughput_memory` draws `zerotune compare`'s bars of throughput and peak memory per run, with the run folders
in its `Source` chunk.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from finetune.run import console
from finetune.run.metrics import METRICS_FILE, MetricsError, read_metrics

# (panel title, y label, series drawn in it: (metrics key, line style, legend suffix))
PANELS = [
    ("loss", "loss", [("loss", "-", ""), ("eval_loss", "o--", " eval")]),
    ("learning rate", "lr", [("lr", "-", "")]),
    ("throughput", "tokens/s (all ranks)", [("tokens_per_s", "-", "")]),
    ("peak memory", "GiB per rank", [("peak_mem_gib", "-", ""), ("peak_reserved_gib", ":", " reserved")]),
]


class PlotError(ValueError):
    """A run folder or output the user must fix; the message says how."""


class MissingMatplotlib(PlotError):
    """matplotlib is not installed: only the drawing needs it (the `plot` extra)."""


INSTALL_HINT = "pip install 'zerotune[plot]'"


def load_run(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """{metrics key: [(step, value), ...]} from run_dir/metrics.jsonl; None values (e.g. MFU on CPU) are skipped."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        what = "does not exist" if not os.path.exists(run_dir) else f"has no {METRICS_FILE}"
        raise PlotError(f"{run_dir!r} {what}: give run folders written by training (train.output_dir)")
    try:
        records = read_metrics(path)
    except MetricsError as e:
        raise PlotError(str(e)) from None
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                series.setdefault(key, []).append((record["step"], value))
    if "loss" not in series:
        raise PlotError(f"{path} has no step records yet: plot it once training has logged a step")
    return series


def labels(run_dirs: list[str]) -> list[str]:
    """The shortest trailing part of each path that tells the runs apart (runs/a/tiny vs runs/b/tiny -> a/tiny, b/tiny)."""
    parts = [os.path.normpath(os.path.abspath(d)).split(os.sep) for d in run_dirs]
    for k in range(1, max(len(p) for p in parts) + 1):
        names = [os.sep.join(p[-k:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return list(run_dirs)  # the same folder given twice


def _pyplot():
    """matplotlib.pyplot drawing to files only (training machines have no display)."""
    try:
        import matplotlib  # lazy: an optional dependency (the `plot` extra), needed only to draw

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingMatplotlib(f"drawing plots needs matplotlib: {INSTALL_HINT}") from None
    return plt


def build_figure(run_dirs: list[str]):
    """The 4-panel figure and, per run, its label and the number of points drawn per series."""
    plt = _pyplot()
    runs = [load_run(d) for d in run_dirs]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    drawn = []
    for i, (run_dir, label, series) in enumerate(zip(run_dirs, labels(run_dirs), runs)):
        color = f"C{i % 10}"
        points = {}
        for ax, (_, _, keys) in zip(axes.flat, PANELS):
            for key, style, suffix in keys:
                if series.get(key):
                    steps, values = zip(*series[key])
                    ax.plot(steps, values, style, color=color, label=label + suffix, markersize=4, linewidth=1.2)
                    points[key] = len(steps)
        drawn.append({"run_dir": run_dir, "label": label, "points": points})
    for ax, (title, ylabel, _) in zip(axes.flat, PANELS):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    axes.flat[1].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    fig.tight_layout()
    return fig, drawn


def plot_runs(run_dirs: list[str], out: str) -> list[dict[str, Any]]:
    """Write the PNG; returns per run its folder, label and points drawn per series (also in the PNG's Source chunk)."""
    if not out.lower().endswith(".png"):
        raise PlotError(f"--out {out!r}: give a .png file name")
    fig, drawn = build_figure(run_dirs)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100, metadata={"Title": "zerotune training curves", "Source": json.dumps(drawn)})
    _pyplot().close(fig)
    return drawn


def _save(fig, path: str, runs: list[dict[str, Any]], title: str) -> list[str]:
    sources = [r["run_dir"] for r in runs]
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Title": title, "Source": json.dumps(sources)})
    _pyplot().close(fig)
    return sources


def plot_throughput_memory(runs: list[dict[str, Any]], path: str) -> list[str]:
    """Bars of tokens/s per GPU, and of peak memory (allocated and reserved as recorded, and estimated) per run;
    returns the sources."""
    plt = _pyplot()
    ok = [r for r in runs if r.get("tokens_per_s_per_gpu") is not None]
    names = [r["name"] for r in ok]
    x = list(range(len(ok)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(x, [r["tokens_per_s_per_gpu"] for r in ok], color="tab:blue")
    ax1.set_xticks(x, names, rotation=20)
    ax1.set_ylabel("tokens/s per GPU")
    ax1.set_title("throughput (after the skipped first steps)")
    series = [("peak_mem_gib", "measured allocated"), ("peak_reserved_gib", "measured reserved"),
              ("estimated_gib", "estimated")]
    series = [(key, label) for key, label in series if any(r.get(key) is not None for r in ok)]
    width = 0.8 / max(1, len(series))
    for k, (key, label) in enumerate(series):
        ax2.bar([i + (k - (len(series) - 1) / 2) * width for i in x], [r.get(key) or 0.0 for r in ok], width, label=label)
    ax2.set_xticks(x, names, rotation=20)
    ax2.set_ylabel("GiB per GPU")
    ax2.set_title("peak memory")
    ax2.legend(fontsize=8)
    return _save(fig, path, ok, "throughput and memory per ZeRO stage")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zerotune plot", description=__doc__.splitlines()[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help=f"run folders (train.output_dir) holding {METRICS_FILE}")
    p.add_argument("--out", required=True, metavar="FILE.png", help="PNG file to write")
    args = p.parse_args(argv)
    try:
        drawn = plot_runs(args.run_dirs, args.out)
    except PlotError as e:
        console.error(e)
        return 2
    steps = ", ".join(f"{d['label']} ({d['points']['loss']} steps, {d['points'].get('eval_loss', 0)} evals)" for d in drawn)
    print(f"wrote {args.out}: {steps}")
    return 0
