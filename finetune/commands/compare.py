"""`zerotune compare`: train one recipe under several ZeRO stages, one after another, and summarise speed, memory and loss.

    zerotune compare --config recipes/tiny.yaml --stages 0 1 2 3 --steps 10 --gpus 2 --out runs/compare

Each stage is a real `deepspeed` launch of finetune/main.py with ds_configs/zero{stage}.json (and zero{2,3}_offload.json
with --offload) on 127.0.0.1, its run folder DIR/<name>. DIR gets summary.md and summary.json, then
throughput_memory.png and loss_curves.png (skipped with a note without matplotlib, the `plot` extra). A stage whose
losses differ from the first stage's by more than the tolerance is flagged: every stage trains the same model on the
same data in the same order, so its losses must agree up to rounding. A recipe without weights (config.json only) is
no exception: its random init is drawn the same under every stage (finetune/model/init_weights.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from finetune import dist, shipped
from finetune.commands.plot import INSTALL_HINT, MissingMatplotlib, plot_runs, plot_throughput_memory
from finetune.config import ConfigError, load_recipe
from finetune.ds_config import offloads_optimizer, zero_stage
from finetune.memory.budget import describe_checkpointing
from finetune.memory.estimate import GIB, estimate_run
from finetune.run import console
from finetune.run import folder as run_folder
from finetune.run.metrics import METRICS_FILE, read_metrics

OWNED = ("train.output_dir", "train.max_steps")  # compare sets these; --out and --steps say them once for every stage
BF16_TOLERANCE, FP32_TOLERANCE = 2e-2, 1e-4


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="zerotune compare", description="Run one recipe under several ZeRO stages and compare them.")
    p.add_argument("--config", metavar="PATH", default=None, help="YAML recipe (default recipes/mistral7b_lora.yaml)")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument("--offload", action="store_true", help="also run zero2_offload.json and zero3_offload.json (for stages 2, 3)")
    p.add_argument("--budgets", type=float, nargs="+", default=None, metavar="GIB",
                   help="instead of stages: one run per GPU memory budget, `--deepspeed auto train.gpu_memory_gib=GIB` "
                        "(zerotune chooses stage, offload, checkpointing and micro-batch; on CUDA the budget is enforced)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per stage (default 20)")
    p.add_argument("--skip-steps", type=int, default=1,
                   help="first steps left out of throughput and step time: they include warm-up (allocator, kernel "
                        "selection, ZeRO-3's first gathers) (default 1)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs (processes on CPU) per run (default: this machine's GPUs, or 1)")
    p.add_argument("--tolerance", type=float, default=None,
                   help=f"largest allowed |loss - first stage's loss| at any step "
                        f"(default {BF16_TOLERANCE} for bf16 runs, {FP32_TOLERANCE} for fp32)")
    p.add_argument("--ds-dir", default=os.path.join(shipped.ROOT, "ds_configs"), help="folder with zero{0,1,2,3}[_offload].json")
    p.add_argument("--out", required=True, metavar="DIR", help="one run folder per stage, and the summary")
    p.add_argument("--overwrite", action="store_true", help="reuse a non-empty DIR (its run folders are overwritten)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="recipe overrides, the same for every stage")
    return p.parse_args(argv)


def build_runs(stages: list[int], offload: bool, budgets: list[float] | None = None) -> list[str]:
    """Run names, which are also the DeepSpeed JSON names: zero0, zero1, ..., zero2_offload, zero3_offload; or
    budget24, budget40, ... for --budgets."""
    if budgets:
        return [f"budget{b:g}" for b in dict.fromkeys(budgets)]
    names = [f"zero{s}" for s in dict.fromkeys(stages)]
    if offload:
        names += [f"zero{s}_offload" for s in dict.fromkeys(stages) if s in (2, 3)]
    return names


def check_recipe(config: str | None, overrides: list[str]) -> None:
    """The recipe loads and its model folder has a config.json: checked once, before any stage is launched."""
    # lazy: torch and transformers (finetune.model.build imports both) are slow to import; `zerotune compare --help` does
    # without them
    from finetune.model.build import check_model_dir

    check_model_dir(load_recipe(config, overrides).model)


def run_command(name: str, args: argparse.Namespace, gpus: int, port: int) -> list[str]:
    """The `deepspeed` command line of one stage: loopback rendezvous, no sample generation, no export."""
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    budget = name[len("budget"):] if name.startswith("budget") else None
    cmd = [deepspeed if os.path.exists(deepspeed) else "deepspeed", "--num_gpus", str(gpus),
           "--master_addr", "127.0.0.1", "--master_port", str(port), os.path.join(shipped.PACKAGE, "main.py"),
           "--deepspeed", "auto" if budget else os.path.join(args.ds_dir, f"{name}.json")]
    if args.config:
        cmd += ["--config", args.config]
    own = [f"train.max_steps={args.steps}", f"train.output_dir={os.path.join(args.out, name)}",
           "train.sample_prompt=null", "train.export=false", "train.save_every=0"]
    own += [f"train.gpu_memory_gib={budget}"] if budget else []
    return cmd + list(args.overrides) + own + (["train.overwrite=true"] if args.overwrite else [])


def load_steps(path: str) -> list[dict[str, Any]]:
    """The per-step records of a metrics.jsonl (eval lines, which carry eval_loss instead of loss, are left out)."""
    return [r for r in read_metrics(path) if "loss" in r]


def summarize_run(name: str, run_dir: str, steps: list[dict[str, Any]], skip: int, world: int) -> dict[str, Any]:
    """Throughput, MFU and step time over the steps after `skip`; peak memory over all steps; the loss curve."""
    timed = steps[skip:] if len(steps) > skip else steps
    seconds = sum(r["step_time_s"] for r in timed)
    mfus = [r.get("mfu") for r in timed]
    stage, _, offload = name.partition("_")
    return {
        "name": name, "run_dir": run_dir, "stage": int(stage[len("zero"):]) if stage[len("zero"):].isdigit() else None,
        "offload": bool(offload), "world": world, "steps": [r["step"] for r in steps], "losses": [r["loss"] for r in steps],
        "timed_steps": [r["step"] for r in timed],
        # Totals over totals: a mean of per-step rates would overweight fast steps.
        "tokens_per_s_per_gpu": sum(r["tokens"] for r in timed) / seconds / world if seconds else None,
        "mfu": (sum(m * r["step_time_s"] for m, r in zip(mfus, timed)) / seconds) if seconds and None not in mfus else None,
        "step_time_s": seconds / len(timed) if timed else None,
        "peak_mem_gib": max((r["peak_mem_gib"] for r in steps), default=None),
        "peak_reserved_gib": max((r["peak_reserved_gib"] for r in steps if r.get("peak_reserved_gib") is not None), default=None),
        "final_loss": steps[-1]["loss"] if steps else None,
    }


def what_ran(run_dir: str) -> dict[str, Any]:
    """Stage and offload from the run's resolved ds_config.json, and its memory plan when a budget chose them."""
    ds = run_folder.read_json(run_dir, run_folder.DS_CONFIG)
    out = {"stage": zero_stage(ds), "offload": offloads_optimizer(ds), "plan": None}
    if run_folder.has(run_dir, run_folder.MEMORY_PLAN):
        out["plan"] = run_folder.read_json(run_dir, run_folder.MEMORY_PLAN)
        out["ds_config"] = out["plan"]["deepspeed"]
    return out


def estimated_gib(run_dir: str, world: int) -> float | None:
    """finetune.memory.estimate's per-GPU total for the run's own resolved recipe.yaml and ds_config.json."""
    from finetune.model.build import check_model_dir  # lazy: it imports torch (see check_recipe)

    recipe = load_recipe(run_folder.path(run_dir, run_folder.RECIPE))
    ds = run_folder.read_json(run_dir, run_folder.DS_CONFIG)
    return estimate_run(check_model_dir(recipe.model), recipe, ds, world)["total"] / GIB


def compare_losses(runs: list[dict[str, Any]], tolerance: float) -> None:
    """Adds max_loss_diff (against the first run that finished, over the steps both have) and flagged to every run."""
    ref = next((r for r in runs if not r.get("error")), {"losses": []})
    for r in runs:
        if r.get("error"):
            r["max_loss_diff"], r["flagged"] = None, True
            continue
        pairs = list(zip(ref.get("losses", []), r["losses"]))
        r["max_loss_diff"] = max((abs(a - b) for a, b in pairs), default=None)
        missing = len(r["losses"]) != len(ref.get("losses", []))
        r["flagged"] = missing or r["max_loss_diff"] is None or r["max_loss_diff"] > tolerance


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def write_summary(out: str, runs: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """summary.json (everything) and summary.md (the table and how to read it)."""
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({**meta, "runs": runs}, f, indent=2)
    intro = (f"{meta['steps']} steps per stage on {meta['gpus']} {meta['ranks']}; throughput, MFU and step "
             f"time average steps {meta['skip_steps'] + 1}-{meta['steps']} (the first {meta['skip_steps']} left out as "
             f"warm-up); peak memory is the largest over all steps and ranks. Losses are compared step by step with the "
             f"first stage that finished ({meta['reference']}); tolerance {meta['tolerance']:g}.")
    per = "GPU" if meta["ranks"] == "GPUs" else "rank"  # a CPU run's ranks are processes, not GPUs
    header = (f"| run | stage | offload | chosen | tok/s/{per} | MFU | step time (s) | peak allocated (GiB) | peak reserved (GiB) "
              "| estimated (GiB) | final loss | max loss diff | flag |")
    title = "Memory budget comparison" if any(r["name"].startswith("budget") for r in runs) else "ZeRO stage comparison"
    lines = [f"# {title}: {meta['config']}", "", intro, "", header,
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in runs:
        if r.get("error"):
            lines.append(f"| {r['name']} | | | | | | | | | | | | FAILED: {r['error']} |")
            continue
        mfu = None if r["mfu"] is None else 100 * r["mfu"]
        plan = r.get("plan")
        recompute = plan and describe_checkpointing(plan["activation_checkpointing"], plan.get("recompute_layers"),
                                                    plan.get("layers", 0))
        chosen = (f"{os.path.basename(plan['deepspeed'])}, checkpointing {recompute}, "
                  f"micro-batch {plan['micro_batch_size']} x {plan['grad_accum']}" if plan else "")
        lines.append(
            f"| {r['name']} | {r['stage']} | {'yes' if r['offload'] else 'no'} | {chosen} | {_fmt(r['tokens_per_s_per_gpu'], ',.0f')} "
            f"| {_fmt(mfu, '.1f')}{'%' if mfu is not None else ''} | {_fmt(r['step_time_s'], '.3f')} "
            f"| {_fmt(r['peak_mem_gib'], '.2f')} | {_fmt(r['peak_reserved_gib'], '.2f')} | {_fmt(r.get('estimated_gib'), '.2f')} "
            f"| {_fmt(r['final_loss'], '.4f')} | {_fmt(r['max_loss_diff'], '.2e')} "
            f"| {'LOSS DIFFERS' if r['flagged'] else 'ok'} |")
    if meta["plots"]:
        plots = ("Plots: `throughput_memory.png`, `loss_curves.png` (drawn from the run folders listed under `plots` "
                 "in summary.json).")
    else:
        plots = meta.get("plots_note", "Plots: none.")
    lines += ["", *meta["notes"], "", plots]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def summarize(out: str, runs: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """summary.md and summary.json first, so that nothing is lost if a plot cannot be drawn; then the plots (skipped
    with a one-line note without matplotlib) and the summary again, naming them."""
    finished = [r["run_dir"] for r in runs if not r.get("error")]
    redraw = f"`zerotune plot {' '.join(finished)} --out {os.path.join(out, 'loss_curves.png')}`"
    meta["plots_note"] = f"Plots: not drawn yet; {redraw} draws the loss curves." if finished else \
        "Plots: none, no stage finished."
    write_summary(out, runs, meta)
    if not finished:
        return
    try:
        plots = {"throughput_memory.png": plot_throughput_memory(runs, os.path.join(out, "throughput_memory.png"))}
        # `zerotune plot`'s figure: loss, lr, tokens/s and memory per step, one colour per stage
        drawn = plot_runs(finished, os.path.join(out, "loss_curves.png"))
        plots["loss_curves.png"] = [d["run_dir"] for d in drawn]
    except MissingMatplotlib:
        meta["plots_note"] = f"Plots: not drawn, matplotlib is not installed: `{INSTALL_HINT}`, then {redraw}."
        print(f"compare: plots skipped: matplotlib is not installed (`{INSTALL_HINT}` to get them)", file=sys.stderr)
    else:
        meta["plots"] = {k: {"runs": v} for k, v in plots.items()}
        del meta["plots_note"]
    write_summary(out, runs, meta)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    owned = [o for o in args.overrides if o.partition("=")[0] in OWNED]
    if owned:
        console.error(f"{', '.join(owned)}: compare sets these; use --out DIR and --steps N")
        return 2
    if args.steps < 1:
        console.error("--steps must be >= 1")
        return 2
    names = build_runs(args.stages, args.offload, args.budgets)
    missing = [n for n in names if not n.startswith("budget") and not os.path.isfile(os.path.join(args.ds_dir, f"{n}.json"))]
    if missing:
        console.error(f"no {', '.join(m + '.json' for m in missing)} in {args.ds_dir}")
        return 2
    if os.path.isdir(args.out) and os.listdir(args.out) and not args.overwrite:
        console.error(f"--out {args.out!r} is not empty: choose a new folder or pass --overwrite")
        return 2
    local_gpus = dist.local_gpus()
    cuda = bool(local_gpus)
    gpus = args.gpus or max(1, len(local_gpus))
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    bf16 = any(_is_bf16(os.path.join(args.ds_dir, "zero3.json" if n.startswith("budget") else f"{n}.json")) for n in names)
    try:
        check_recipe(args.config, args.overrides)
    except ConfigError as e:
        console.error(e)
        return 2
    env = dict(os.environ, PYTHONPATH=shipped.IMPORT_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine: keep gloo's traffic on loopback
    if not cuda:
        # CPU ranks each start one thread per core by default; oversubscribed, they measure contention, not the stage.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // gpus)))

    runs = []
    for name in names:
        run_dir, log = os.path.join(args.out, name), os.path.join(args.out, "logs", f"{name}.log")
        cmd = run_command(name, args, gpus, dist.free_port())
        print(f"compare: {name}: {' '.join(cmd)}", flush=True)
        with open(log, "w") as f:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False).returncode
        metrics = os.path.join(run_dir, METRICS_FILE)
        steps = load_steps(metrics) if os.path.isfile(metrics) else []
        if code != 0 or not steps:
            runs.append({"name": name, "run_dir": run_dir, "error": f"exit code {code}, see {log}", "losses": []})
            print(f"compare: {name} failed (exit code {code}); its log: {log}", file=sys.stderr)
            continue
        run = summarize_run(name, run_dir, steps, args.skip_steps, gpus)
        run.update(what_ran(run_dir))
        run.setdefault("ds_config", os.path.join(args.ds_dir, f"{name}.json"))
        run["estimated_gib"] = estimated_gib(run_dir, gpus)
        runs.append(run)
        print(f"compare: {name}: {_fmt(run['tokens_per_s_per_gpu'], ',.0f')} tok/s/{'GPU' if cuda else 'rank'}, "
              f"peak {run['peak_mem_gib']:.2f} GiB, final loss {run['final_loss']:.4f}", flush=True)

    tolerance = args.tolerance if args.tolerance is not None else (BF16_TOLERANCE if bf16 else FP32_TOLERANCE)
    compare_losses(runs, tolerance)
    notes = []
    if args.steps <= args.skip_steps:
        notes.append(f"Only {args.steps} step(s), not more than --skip-steps {args.skip_steps}: "
                     f"throughput averages every step, warm-up included.")
    if not cuda:
        notes.append("On CPU, peak memory is each process's peak resident memory (Python, torch, data included), "
                     "so it is not comparable with the estimate, which counts accelerator memory only; MFU needs a known GPU.")
    notes.append(f"Estimated: finetune/memory/estimate.py for each run's resolved {run_folder.RECIPE} and "
                 f"{run_folder.DS_CONFIG} "
                 "(weights, gradients, optimizer states, activations, DeepSpeed buffers), to compare with peak allocated.")
    meta = {"config": args.config or "recipes/mistral7b_lora.yaml", "overrides": args.overrides, "steps": args.steps,
            "skip_steps": args.skip_steps if args.steps > args.skip_steps else 0, "gpus": gpus, "tolerance": tolerance,
            "ranks": "GPUs" if cuda else "CPU processes",
            "reference": next((r["name"] for r in runs if not r.get("error")), None),
            "notes": notes, "plots": {}}
    summarize(args.out, runs, meta)
    with open(os.path.join(args.out, "summary.md")) as f:
        print(f.read())
    flagged = [r["name"] for r in runs if r["flagged"]]
    if flagged:
        print(f"compare: flagged: {', '.join(flagged)} (failed, or losses beyond {tolerance:g} of {meta['reference']})",
              file=sys.stderr)
    return 1 if flagged else 0


def _is_bf16(path: str) -> bool:
    with open(path) as f:
        ds = json.load(f)
    return ds.get("bf16", {}).get("enabled") is True or ds.get("torch_autocast", {}).get("enabled") is True


if __name__ == "__main__":
    sys.exit(main())
