"""The quality gate of model.precision=fp8: bf16 and fp8 from the same init on the same text. For each kind of run,
zerotune trains twice from one saved init, once with model.precision=bf16 and once with fp8, and the losses are
compared step by step: both runs see the same batches in the same order (the same seeds), so the per-step loss is
not noise between them.

    python benchmarks/precision.py --model /tmp/init --tokenizer .gpu/tokenizer --data /tmp/syn.jsonl \
        --out runs/precision/precision.json --runs lora full [--precisions bf16 fp8] [--steps 200]
    python benchmarks/precision.py --smoke --out /tmp/prec_smoke/precision.json    # the whole path on a CPU
    python benchmarks/precision.py --table A.json B.json --out merged.json          # merge several calls, print

Kinds: `lora` is recipes/mistral7b_lora.yaml under ds_configs/zero2.json, `full` is recipes/mistral7b_full.yaml
under ds_configs/zero3.json, each at its recipe's learning rate; rows of --seq tokens, --rows rows per GPU per step,
2% of the documents held out and evaluated at the end. Each run is its own `deepspeed` launch (loopback rendezvous),
killed with its ranks at --timeout. `--smoke` runs the tiny model (recipes/tiny_model) in fp32 on DeepSpeed's CPU
accelerator: its `bf16` run is fp32, its `fp8` run the exact FP8 emulation.

The gate, on the relative difference |fp8 - bf16| / bf16 of the loss at every step after --warmup-skip and of the
final eval loss: LoRA passes with every step within 1% and the eval within 0.5%; full fine-tuning (FP8 in the
trained weights' GEMMs too) with every step within 2% and the eval within 2%. A comparison whose fp8 run did not
apply FP8 (its speedups.json) never passes. Writes --out (runs, comparisons, environment) and a plot beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.preference import _environment  # noqa: E402
from benchmarks.vs_peer import launch, versions  # noqa: E402
from finetune.run.metrics import read_metrics  # noqa: E402

KINDS = {"lora": ("recipes/mistral7b_lora.yaml", "zero2"), "full": ("recipes/mistral7b_full.yaml", "zero3"),
         "lora_zero3": ("recipes/mistral7b_lora.yaml", "zero3")}  # speed only: its gate is lora's
PRECISIONS = ("bf16", "fp8")
GATE = {"lora": {"step": 0.01, "eval": 0.005}, "full": {"step": 0.02, "eval": 0.02}}  # largest relative difference
ON = {True: "yes", False: "no", None: "?"}  # speedups.json's fp8 entry; ? = the run wrote none


def _ds_file(stage: str, smoke: bool, workdir: str) -> str:
    """ds_configs/<stage>.json; under --smoke its fp32 twin, written beside the results where none is shipped."""
    if not smoke:
        return f"ds_configs/{stage}.json"
    shipped = f"ds_configs/{stage}_fp32.json"
    if os.path.exists(os.path.join(ROOT, shipped)):
        return shipped
    ds = json.load(open(os.path.join(ROOT, f"ds_configs/{stage}.json")))
    ds["bf16"] = {"enabled": False}
    path = os.path.join(workdir, f"{stage}_fp32.json")
    json.dump(ds, open(path, "w"), indent=2)
    return path


def run_one(kind: str, precision: str, a: argparse.Namespace) -> dict:
    """One zerotune run of `kind` at `precision`: its losses, eval loss, tok/s/GPU, peak memory and whether FP8 ran."""
    recipe, stage = KINDS[kind]
    out = os.path.join(a.workdir, f"{kind}_{precision}")
    script = ["finetune/main.py", "--deepspeed", _ds_file(stage, a.smoke, a.workdir), "--config", recipe,
              f"model.path={a.model}", f"model.tokenizer={a.tokenizer}", f"model.precision={precision}",
              f"data.path={a.data}", "data.format=text", "data.overlong=truncate", f"data.max_seq_len={a.seq}",
              "data.eval_fraction=0.02", f"train.micro_batch_size={a.rows}", "train.grad_accum=1",
              f"train.max_steps={a.steps}", f"train.output_dir={out}", "train.overwrite=true",
              "train.sample_prompt=null", "train.export=false", "train.save_every=0", "train.log_every=1",
              "train.eval_every=0"]  # eval once, at the last step
    code, tail, wall = launch(script, a.gpus, out + ".log", a.timeout, a.env)
    result = {"kind": kind, "precision": precision, "exit": code, "wall_s": wall,
              "command": f"deepspeed --num_gpus {a.gpus} " + " ".join(script)}
    return read_run(result, out, tail, a)


def read_run(result: dict, out: str, tail: str, a: argparse.Namespace) -> dict:
    """A run's figures from its folder `out` (metrics.jsonl, speedups.json); `result` holds its kind, precision and
    exit code."""
    code = result["exit"]
    metrics = os.path.join(out, "metrics.jsonl")
    records = read_metrics(metrics) if os.path.exists(metrics) else []
    steps = [r for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    speedups = os.path.join(out, "speedups.json")
    on = {s["name"]: s["on"] for s in json.load(open(speedups))} if os.path.exists(speedups) else {}
    result.update(steps=[r["step"] for r in steps], losses=[r["loss"] for r in steps],
                  eval_loss=evals[-1] if evals else None, fp8_applied=on.get("fp8"))
    timed = steps[a.skip:]
    # A run stopped by its time limit after its last step and its eval (while the process shut down) has every figure
    # the gate compares: it counts, and says so.
    finished = code == 0 or (code == 124 and len(steps) >= a.steps and evals)
    if not finished or not timed:
        return {**result, "error": tail}
    if code != 0:
        result["note"] = "stopped by its time limit after its last step and eval"
    seconds = sum(r["step_time_s"] for r in timed)
    return {**result, "tokens_per_s_per_gpu": sum(r["tokens"] for r in timed) / seconds / a.gpus,
            "peak_mem_gib": max(r["peak_mem_gib"] for r in steps)}


def compare(bf16: dict, fp8: dict, warmup_skip: int) -> dict:
    """The gate on one kind's pair of runs: relative loss differences at each common step after `warmup_skip`, the
    eval loss's, tok/s and memory; `verdict` PASS only when both ran, FP8 was on in the fp8 run only, and every
    difference is within GATE. `reasons` says what failed."""
    kind = bf16["kind"]
    gate = GATE[kind.split("_")[0]]  # lora_zero3 is held to lora's gate
    result = {"kind": kind, "warmup_skip": warmup_skip, "gate": gate}
    reasons = [f"{r['precision']} run failed (exit {r['exit']})" for r in (bf16, fp8) if "error" in r]
    if "error" not in fp8 and fp8.get("fp8_applied") is not True:
        reasons.append("fp8 was not applied (speedups.json)")
    if bf16.get("fp8_applied"):
        reasons.append("the bf16 run applied fp8")
    fp8_losses = dict(zip(fp8.get("steps", []), fp8.get("losses", [])))
    diffs = [(step, abs(fp8_losses[step] - loss) / abs(loss))
             for step, loss in zip(bf16.get("steps", []), bf16.get("losses", [])) if step > warmup_skip and step in fp8_losses]
    if diffs:
        step, largest = max(diffs, key=lambda d: d[1])
        result.update(step_diffs=diffs, largest=largest, largest_step=step, final=diffs[-1][1])
        if largest > gate["step"]:
            reasons.append(f"step difference {largest:.2%} at step {step} > {gate['step']:.1%}")
    else:
        reasons.append(f"no common step after the first {warmup_skip}")
    if bf16.get("eval_loss") is not None and fp8.get("eval_loss") is not None:
        result["eval"] = abs(fp8["eval_loss"] - bf16["eval_loss"]) / abs(bf16["eval_loss"])
        if result["eval"] > gate["eval"]:
            reasons.append(f"eval difference {result['eval']:.2%} > {gate['eval']:.1%}")
    else:
        reasons.append("no eval loss")
    if bf16.get("tokens_per_s_per_gpu") and fp8.get("tokens_per_s_per_gpu"):
        result["speed_ratio"] = fp8["tokens_per_s_per_gpu"] / bf16["tokens_per_s_per_gpu"]
    result["peak_mem_gib"] = {"bf16": bf16.get("peak_mem_gib"), "fp8": fp8.get("peak_mem_gib")}
    return {**result, "verdict": "FAIL" if reasons else "PASS", "reasons": reasons}


def comparisons(runs: list[dict], warmup_skip: int) -> list[dict]:
    """compare() for each kind that has both precisions among `runs` (the last result of each wins)."""
    by = {(r["kind"], r["precision"]): r for r in runs}
    return [compare(by[(k, "bf16")], by[(k, "fp8")], warmup_skip) for k in KINDS
            if (k, "bf16") in by and (k, "fp8") in by]


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def table(runs: list[dict], compared: list[dict]) -> str:
    lines = ["| kind | precision | exit | steps | final loss | eval loss | tok/s/GPU | peak GiB | fp8 on | wall s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in sorted(runs, key=lambda r: (list(KINDS).index(r["kind"]), r["precision"])):
        final = r["losses"][-1] if r.get("losses") else None
        lines.append(f"| {r['kind']} | {r['precision']} | {r['exit']} | {len(r.get('losses', []))} | "
                     f"{_fmt(final, '.4f')} | {_fmt(r.get('eval_loss'), '.4f')} | "
                     f"{_fmt(r.get('tokens_per_s_per_gpu'), ',.0f')} | {_fmt(r.get('peak_mem_gib'), '.1f')} | "
                     f"{ON[r.get('fp8_applied')]} | {r['wall_s']:.0f} |")
    for c in compared:
        gate, parts = c["gate"], []
        if "largest" in c:
            parts.append(f"largest step difference {c['largest']:.2%} at step {c['largest_step']} "
                         f"(gate {gate['step']:.1%}), final {c['final']:.2%}")
        if "eval" in c:
            parts.append(f"eval {c['eval']:.2%} (gate {gate['eval']:.1%})")
        if "speed_ratio" in c:
            parts.append(f"tok/s fp8/bf16 {c['speed_ratio']:.2f}x")
        mem = c["peak_mem_gib"]
        if None not in mem.values():
            parts.append(f"peak {mem['bf16']:.1f} -> {mem['fp8']:.1f} GiB")
        verdict = c["verdict"] + (f" ({'; '.join(c['reasons'])})" if c["reasons"] else "")
        lines.append(f"{c['kind']}, steps after {c['warmup_skip']}: {', '.join(parts)}: {verdict}")
    return "\n".join(lines)


def plot(runs: list[dict], compared: list[dict], path: str) -> None:
    """Per kind: the two loss curves above, the relative difference (%) below with the gate's line."""
    try:  # matplotlib is a dev dependency: without it the table and JSON are the result
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["kind"], r["precision"]): r for r in runs}
    kinds = [k for k in KINDS if any((k, p) in by for p in PRECISIONS)]
    if not kinds:
        return
    diffs = {c["kind"]: c for c in compared}
    fig, axes = plt.subplots(2, len(kinds), figsize=(6 * len(kinds), 6), sharex="col", squeeze=False)
    for col, kind in enumerate(kinds):
        top, bottom = axes[0][col], axes[1][col]
        for precision, color in zip(PRECISIONS, ("#1f77b4", "#d62728")):
            r = by.get((kind, precision))
            if r and r.get("losses"):
                top.plot(r["steps"], r["losses"], color=color, lw=1, label=precision)
        top.set_title(f"{kind}: loss")
        top.legend(fontsize=8)
        c = diffs.get(kind, {})
        if c.get("step_diffs"):
            bottom.plot([s for s, _ in c["step_diffs"]], [100 * d for _, d in c["step_diffs"]], color="black", lw=1)
        bottom.axhline(100 * GATE[kind.split("_")[0]]["step"], color="red", ls="--", lw=1, label="gate")
        bottom.set_ylabel("|fp8 - bf16| / bf16 (%)")
        bottom.set_xlabel("step")
        bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _environment_record() -> dict:
    from importlib import metadata

    found = versions()
    try:
        found["torchao"] = metadata.version("torchao")
    except metadata.PackageNotFoundError:
        found["torchao"] = "absent"
    return {**found, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def save(path: str, runs: list[dict], compared: list[dict], settings: dict) -> None:
    with open(path, "w") as f:
        json.dump({"runs": runs, "comparisons": compared, "settings": settings,
                   "environment": _environment_record()}, f, separators=(",", ":"))  # compact: results live in docs/benchmarks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="saved Mistral-7B-shaped init (a folder)")
    p.add_argument("--tokenizer", default="mistral-common")
    p.add_argument("--data", help="text JSONL (benchmarks/synthetic_data.py)")
    p.add_argument("--out", default="runs/precision/precision.json", help="results JSON; runs and plot beside it")
    p.add_argument("--runs", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rows", type=int, default=4, help="rows per GPU per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup-skip", type=int, default=20, help="steps left out of the loss comparison")
    p.add_argument("--skip", type=int, default=3, help="steps left out of the timing")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    p.add_argument("--smoke", action="store_true", help="the tiny model on a CPU, a few steps")
    p.add_argument("--table", nargs="+", metavar="JSON", help="merge these result files (later ones win), print the "
                                                              "table, write --out and its plot")
    p.add_argument("--reread", action="store_true", help="with --table: read each run again from its folder beside "
                   "its file (its metrics.jsonl), as the current rules judge it")
    a = p.parse_args(argv)
    png = os.path.splitext(a.out)[0] + ".png"
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    if a.table:
        merged, settings = {}, {}
        for path in a.table:
            loaded = json.load(open(path))
            settings = {**loaded.get("settings", {}), **settings}  # the first file's, for the record
            if a.reread:  # each run judged again from its folder beside the file
                keep = ("kind", "precision", "exit", "wall_s", "command")
                loaded["runs"] = [read_run({k: r[k] for k in keep}, os.path.join(
                    os.path.dirname(path), f"{r['kind']}_{r['precision']}"), r.get("error", ""),
                    argparse.Namespace(**{**vars(a), **loaded.get("settings", {})})) for r in loaded["runs"]]
            merged.update({(r["kind"], r["precision"]): r for r in loaded["runs"]})
        runs = list(merged.values())
        compared = comparisons(runs, a.warmup_skip)
        print(table(runs, compared))
        save(a.out, runs, compared, {**settings, "warmup_skip": a.warmup_skip, "merged": a.table})
        plot(runs, compared, png)
        return 0
    a.workdir = os.path.dirname(os.path.abspath(a.out))
    if a.smoke:  # rows of 256 tokens of random words, so that a CPU runs a few steps of each kind in minutes
        a.model, a.tokenizer, a.seq, a.rows, a.gpus = "recipes/tiny_model", "mistral-common", 256, 2, 1
        a.steps, a.warmup_skip, a.skip = 6, 1, 1
        a.data = os.path.join(a.workdir, "text.jsonl")
        subprocess.run([sys.executable, "benchmarks/synthetic_data.py", a.data, "--docs", "60", "--words", "200"],
                       check=True, cwd=ROOT)
    elif not (a.model and a.data):
        p.error("--model and --data are needed (or --smoke, or --table)")
    a.env = _environment(a.smoke)
    settings = {k: getattr(a, k) for k in ("model", "data", "steps", "rows", "seq", "warmup_skip", "skip", "gpus",
                                           "smoke")}
    runs: list[dict] = []
    started = time.monotonic()
    for kind in a.runs:
        for precision in a.precisions:
            r = run_one(kind, precision, a)
            runs.append(r)
            save(a.out, runs, comparisons(runs, a.warmup_skip), settings)  # a call cut short keeps its runs
            what = (f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, peak {r['peak_mem_gib']:.1f} GiB, "
                    f"fp8 {'on' if r['fp8_applied'] else 'off'}" if "error" not in r
                    else f"failed, exit {r['exit']}\n{r['error']}")
            print(f"{kind} {precision}: {what} ({r['wall_s']:.0f} s; {time.monotonic() - started:.0f} s since "
                  f"start)", flush=True)
    compared = comparisons(runs, a.warmup_skip)
    save(a.out, runs, compared, settings)
    print(table(runs, compared))
    plot(runs, compared, png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
