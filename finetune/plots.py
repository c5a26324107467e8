"""PNG bars of a stage comparison: throughput and peak memory (measured and estimated) per run.

    plot_throughput_memory(summaries, "runs/cmp/throughput_memory.png")

The PNG carries the run folders it was drawn from in its `Source` text chunk (and compare lists them in summary.json),
so a plot can always be traced back to the metrics.jsonl files behind it. Curves over steps are finetune/curves.py's.
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
