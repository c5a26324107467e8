"""PNG plots of a stage comparison: throughput and memory per run, loss curves overlaid.

    plot_throughput_memory(summaries, "runs/cmp/throughput_memory.png"); plot_losses(summaries, "runs/cmp/loss_curves.png")

Each PNG carries the run folders it was drawn from in its `Source` text chunk (and compare lists them in summary.json),
so a plot can always be traced back to the metrics.jsonl files behind it.
"""

from __future__ import annotations

import json
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str, runs: list[dict[str, Any]], title: str) -> list[str]:
    sources = [r["run_dir"] for r in runs]
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Title": title, "Source": json.dumps(sources)})
    _pyplot().close(fig)
    return sources


def plot_throughput_memory(runs: list[dict[str, Any]], path: str) -> list[str]:
    """Bars of tokens/s per GPU, and of peak memory (measured allocated, reserved, estimated) per run; returns the sources."""
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


def plot_losses(runs: list[dict[str, Any]], path: str) -> list[str]:
    """Training loss per step, one line per run; returns the sources."""
    plt = _pyplot()
    ok = [r for r in runs if r.get("losses")]
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, r in enumerate(ok):
        # Dashes of different lengths keep identical curves (the expected case) distinguishable.
        ax.plot(r["steps"], r["losses"], label=r["name"], linestyle=(0, (6 - k % 4, 1 + k % 4)), marker=".")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("loss per ZeRO stage")
    ax.legend(fontsize=8)
    return _save(fig, path, ok, "loss curves per ZeRO stage")
