"""Long context on one GPU: zerotune at its defaults against HF Trainer + DeepSpeed ZeRO-2 with liger-kernel,
activation checkpointing and micro-batch 1 (benchmarks/peer_hf_trainer.py), on Mistral-7B's shape, one document per
row, LoRA r16 (seven projections) or full fine-tuning.

    python benchmarks/long_context.py --model /tmp/init --out DIR                      # the ladder, both systems
    python benchmarks/long_context.py --model /tmp/init --out DIR --lengths 32768      # only these lengths
    python benchmarks/long_context.py --table DIR/long_context.json [MORE.json ...] --plot PNG

The ladder doubles the tokens per row from --start (8,192) up to --max-length; each system climbs it until a run
fails (out of memory, or its time limit, --run-timeout), so the last length it passed is the longest it trains for
--steps steps. Every run is its own `deepspeed` launch (loopback rendezvous). The table gives tokens/s per GPU (the
steps after --skip) and the peak memory per length; the JSON keeps each run's log tail and, for zerotune, what its
planner printed.

zerotune gets no length-specific setting: `--deepspeed auto`, the shipped recipe, the work (data, steps, one row of
L tokens per step) and, past the model's max_position_embeddings, `model.rope_scaling` (YaRN to L), which the peer
runs without (transformers then extrapolates RoPE; the throughput is the same). The rows are documents at least as
long as the row (benchmarks/synthetic_data.py; zerotune truncates each to L, `data.overlong=truncate`), so the figure
shows the cost of attention over the whole row, not a gain from packing short documents.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.vs_peer import launch, versions  # noqa: E402
from finetune.run.metrics import read_metrics  # noqa: E402

SYSTEMS = ("zerotune", "peer", "alst")
LABELS = {"zerotune": "zerotune, defaults", "peer": "HF Trainer + DeepSpeed", "alst": "DeepSpeed ALST parts"}


def write_documents(path: str, length: int, count: int) -> str:
    """`count` random-word documents of at least `length` tokens each (a word is one token or more)."""
    if not os.path.exists(path):
        subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "synthetic_data.py"), path, "--docs",
                        str(count), "--words", str(length)], check=True, stdout=subprocess.DEVNULL)
    return path


def model_context(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        return int(json.load(f)["max_position_embeddings"])


def run_zerotune(kind: str, length: int, a: argparse.Namespace) -> dict:
    out = os.path.join(a.out, f"zerotune_{kind}_{length}")
    data = write_documents(os.path.join(a.out, f"docs_{length}.jsonl"), length, a.steps + 1)
    sets = [f"model.path={a.model}", f"model.tokenizer={a.tokenizer}", f"data.path={data}", "data.format=text",
            "data.overlong=truncate", f"data.max_seq_len={length}", "train.micro_batch_size=1", "train.grad_accum=1",
            f"train.max_steps={a.steps}", "optim.warmup_steps=1", f"train.output_dir={out}", "train.overwrite=true",
            "train.sample_prompt=null", "train.export=false", "train.save_every=0", "train.eval_every=0"]
    context = model_context(a.model)
    if length > context:  # positions past the model's range: YaRN stretches RoPE to the row
        sets.append(f"model.rope_scaling={{rope_type: yarn, factor: {length / context:g}, "
                    f"original_max_position_embeddings: {context}}}")
    script = ["finetune/main.py", "--deepspeed", a.deepspeed, "--config", f"recipes/mistral7b_{kind}.yaml", *sets, *a.set]
    code, tail, wall = launch(script, 1, out + ".log", a.run_timeout)
    result = {"system": "zerotune", "kind": kind, "length": length, "exit": code, "wall_s": wall,
              "plan": _plan(out + ".log")}
    metrics = os.path.join(out, "metrics.jsonl")
    steps = [r for r in read_metrics(metrics) if "loss" in r] if os.path.exists(metrics) else []
    if code != 0 or len(steps) < a.steps:
        return {**result, "error": _why(code, tail, a.run_timeout)}
    timed = steps[a.skip:]
    seconds = sum(r["step_time_s"] for r in timed)
    return {**result, "tokens_per_s_per_gpu": sum(r["tokens"] for r in timed) / seconds,
            "step_time_s": seconds / len(timed), "peak_mem_gib": max(r["peak_mem_gib"] for r in steps),
            "peak_host_gib": max(r.get("peak_host_gib", 0.0) for r in steps), "losses": [r["loss"] for r in steps]}


def _run_other(system: str, kind: str, length: int, a: argparse.Namespace, script: list[str], settings: str) -> dict:
    """One launch of a peer's script, which writes its figures to OUT.json (`--out`)."""
    out = os.path.join(a.out, f"{system}_{kind}_{length}")
    script = [*script, "--seq", str(length), "--steps", str(a.steps), "--skip", str(a.skip), "--out", out + ".json",
              *(["--lora"] if kind == "lora" else [])]
    code, tail, wall = launch(script, 1, out + ".log", a.run_timeout)
    result = {"system": system, "kind": kind, "length": length, "exit": code, "wall_s": wall, "settings": settings}
    if code != 0 or not os.path.exists(out + ".json"):
        return {**result, "error": _why(code, tail, a.run_timeout)}
    measured = json.load(open(out + ".json"))
    return {**result, **{k: measured[k] for k in ("tokens_per_s_per_gpu", "step_time_s", "peak_mem_gib",
                                                  "peak_host_gib", "losses") if k in measured}}


def run_peer(kind: str, length: int, a: argparse.Namespace) -> dict:
    script = ["benchmarks/peer_hf_trainer.py", "--model", a.model, "--zero", "2", "--micro-batch", "1",
              "--grad-accum", "1", "--checkpointing", "on", "--liger", "on"]
    return _run_other("peer", kind, length, a, script, "ZeRO-2, liger, checkpointing, micro-batch 1")


def run_alst(kind: str, length: int, a: argparse.Namespace) -> dict:
    """DeepSpeed's own long-sequence parts (benchmarks/peer_alst.py): tiled MLP, tiled logits loss, offloaded
    checkpoints, liger, on the same one row of `length` tokens."""
    return _run_other("alst", kind, length, a, ["benchmarks/peer_alst.py", "--model", a.model],
                      "ZeRO-2, SDPA, TiledMLP, TiledFusedLogitsLoss, offloaded checkpoints, liger")


def _plan(log: str) -> str:
    """The lines zerotune's planner printed (`memory plan ...` and what follows it), or ''."""
    try:
        text = open(log).read()
    except OSError:
        return ""
    found = re.search(r"^.*memory plan.*(?:\n(?: {2,}|\|).*)*", text, re.M)
    return found.group(0) if found else ""


def _why(code: int, tail: str, timeout: int) -> str:
    if code == 124:
        return f"time limit ({timeout} s)"
    if "out of memory" in tail.lower() or "OutOfMemoryError" in tail:
        return "out of memory\n" + tail
    return tail


def ladder(start: int, top: int) -> list[int]:
    lengths, n = [], start
    while n <= top:
        lengths.append(n)
        n *= 2
    return lengths


def table(results: list[dict]) -> str:
    lines = ["| system | kind | tokens/row | tok/s/GPU | step s | peak GiB | zerotune / peer | note |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    by = {(r["system"], r["kind"], r["length"]): r for r in results}
    for kind in sorted({r["kind"] for r in results}):
        for length in sorted({r["length"] for r in results if r["kind"] == kind}):
            ours = by.get(("zerotune", kind, length), {}).get("tokens_per_s_per_gpu")
            peer = by.get(("peer", kind, length), {}).get("tokens_per_s_per_gpu")
            for system in SYSTEMS:
                r = by.get((system, kind, length))
                if r is None:
                    continue
                if "tokens_per_s_per_gpu" not in r:
                    note = r.get("error", "").splitlines()[0] if r.get("error") else f"exit {r['exit']}"
                    lines.append(f"| {system} | {kind} | {length:,} | failed | | | | {note} |")
                    continue
                ratio = f"{ours / peer:.2f}" if system == "zerotune" and ours and peer else ""
                lines.append(f"| {system} | {kind} | {length:,} | {r['tokens_per_s_per_gpu']:,.0f} | "
                             f"{r['step_time_s']:.2f} | {r['peak_mem_gib']:.1f} | {ratio} | |")
    for kind in sorted({r["kind"] for r in results}):
        for system in SYSTEMS:
            passed = [r["length"] for r in results if r["system"] == system and r["kind"] == kind
                      and "tokens_per_s_per_gpu" in r]
            if passed:
                lines.append(f"\nlongest {kind} row {system} trained: {max(passed):,} tokens")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    """tokens/s per GPU and peak memory against tokens per row, one line per system and kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for system in SYSTEMS:
        for kind in sorted({r["kind"] for r in results}):
            done = sorted((r["length"], r["tokens_per_s_per_gpu"], r["peak_mem_gib"]) for r in results
                          if r["system"] == system and r["kind"] == kind and "tokens_per_s_per_gpu" in r)
            if not done:
                continue
            label = f"{LABELS[system]} ({kind})"
            style = {"zerotune": "-o", "peer": "--s", "alst": ":^"}[system]
            left.plot([d[0] for d in done], [d[1] for d in done], style, label=label)
            right.plot([d[0] for d in done], [d[2] for d in done], style, label=label)
    for ax, ylabel in ((left, "tokens/s per GPU"), (right, "peak GPU memory, GiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per row")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    fig.suptitle("Mistral-7B shape on one GPU, one document per row")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="saved Mistral-7B-shaped model folder (bf16)")
    p.add_argument("--tokenizer", default="mistral-common")
    p.add_argument("--out", default="runs/long_context")
    p.add_argument("--systems", nargs="+", default=["zerotune", "peer"], choices=SYSTEMS,
                   help="alst: DeepSpeed's long-sequence parts (benchmarks/peer_alst.py)")
    p.add_argument("--kinds", nargs="+", default=["lora"], choices=["lora", "full"])
    p.add_argument("--lengths", nargs="+", type=int, help="measure only these tokens per row (no ladder)")
    p.add_argument("--start", type=int, default=8192)
    p.add_argument("--max-length", type=int, default=262144)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--skip", type=int, default=1, help="steps left out of the averages (compilation, warm-up)")
    p.add_argument("--run-timeout", type=int, default=300, help="seconds per run, model load included")
    p.add_argument("--set", nargs="*", default=[], help="extra zerotune recipe overrides (A/B experiments)")
    p.add_argument("--deepspeed", default="auto", help="zerotune's --deepspeed: `auto` (the planner) or a JSON, with "
                   "--set naming the checkpointing, to run a plan the planner would not choose")
    p.add_argument("--resume", action="store_true", help="keep the runs already in OUT/long_context.json")
    p.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="start no run after this many seconds (rerun with --resume for the rest)")
    p.add_argument("--table", nargs="+", metavar="JSON", help="only merge these result files and print the table")
    p.add_argument("--plot", metavar="PNG", help="also draw tokens/s and peak memory against length")
    a = p.parse_args(argv)
    if a.table:
        merged = {}
        for path in a.table:
            for r in json.load(open(path))["runs"]:
                merged[(r["system"], r["kind"], r["length"])] = r
        print(table(list(merged.values())))
        if a.plot:
            plot(list(merged.values()), a.plot)
        return 0
    os.makedirs(a.out, exist_ok=True)
    out_json = os.path.join(a.out, "long_context.json")
    results = json.load(open(out_json))["runs"] if a.resume and os.path.exists(out_json) else []
    started = time.monotonic()
    lengths = a.lengths or ladder(a.start, a.max_length)
    for kind in a.kinds:
        for system in a.systems:
            for length in lengths:
                previous = [r for r in results if (r["system"], r["kind"], r["length"]) == (system, kind, length)]
                if previous:
                    if "tokens_per_s_per_gpu" not in previous[0] and not a.lengths:
                        break  # this system's ladder already ended here
                    continue
                if a.stop_after is not None and time.monotonic() - started > a.stop_after:
                    print(f"--stop-after {a.stop_after:g} s: the rest is left for --resume", flush=True)
                    print(table(results))
                    return 3
                r = {"zerotune": run_zerotune, "peer": run_peer, "alst": run_alst}[system](kind, length, a)
                results.append(r)
                print(f"{system} {kind} {length}: " + (
                    f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, {r['peak_mem_gib']:.1f} GiB"
                    if "tokens_per_s_per_gpu" in r else f"failed: {r['error'][-2000:]}")
                      + f" ({r['wall_s']:.0f} s)", flush=True)
                with open(out_json, "w") as f:
                    json.dump({"runs": results, "steps": a.steps, "skip": a.skip, "versions": versions()}, f, indent=2)
                if "tokens_per_s_per_gpu" not in r and not a.lengths:
                    break  # the ladder ends at this system's first failure
    print(table(results))
    if a.plot:
        plot(results, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
