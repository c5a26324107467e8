"""zerotune at its defaults against HF Trainer + DeepSpeed (benchmarks/peer_hf_trainer.py) at its defaults and at its
best hand-tuned settings, on the same work: Mistral-7B's shape (one saved random init), rows of 2,048 tokens, 8 rows
per GPU per step, bf16, AdamW; full fine-tuning and LoRA r16 (seven projections) under ZeRO-2 and ZeRO-3.

    python benchmarks/vs_peer.py --model /tmp/init --tokenizer .gpu/tokenizer --data /tmp/syn.jsonl --gpus 2 --out DIR
    python benchmarks/vs_peer.py --table DIR/vs_peer.json [MORE.json ...]      # merge runs of several calls, print

Each run is its own `deepspeed` launch (loopback rendezvous); a failed run is recorded with its log's tail and the
rest go on. Prints a table (tok/s/GPU, MFU, peak memory, ratios, the targets) and writes DIR/vs_peer.json.
zerotune gets no performance flag: only the recipe, the DeepSpeed file and the work (data, steps, batch).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from finetune.dist import free_port  # noqa: E402
from finetune.run.metrics import read_metrics  # noqa: E402
CONFIGS = ("full_zero2", "full_zero3", "lora_zero2", "lora_zero3")
ROWS = 8  # rows per GPU per step (the peer's default micro-batch)
PEER = {  # (micro-batch, grad_accum, checkpointing, liger); "best": tuned by hand on 2xH200
    "peer_default": {c: (8, 1, "on", "off") for c in CONFIGS},
    "peer_best": {"full_zero2": (4, 2, "off", "on"), "full_zero3": (4, 2, "off", "off"),
                  "lora_zero2": (8, 1, "off", "on"), "lora_zero3": (8, 1, "on", "off")},
}
# tok/s/GPU that zerotune's defaults aim for on 2xH200 (the table's target column, the plot's red ticks)
TARGETS = {"full_zero2": 12000, "full_zero3": 11000, "lora_zero2": 18000, "lora_zero3": 12000}
H200_TFLOPS = 989.0


def issue_flops_per_token(seq: int) -> float:
    """6N + 12·L·h·s for Mistral-7B (N = 7,241,732,096, embeddings included): the count behind the targets and the
    peer's own measurements, so the MFU column compares with theirs (finetune.run.metrics counts the matmuls only, and
    attention exactly)."""
    return 6 * 7_241_732_096 + 12 * 32 * 4096 * seq


def launch(script: list[str], gpus: int, log: str, timeout: int,
           env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """(exit code, the log's last lines, wall seconds) of one `deepspeed` launch; `env` adds variables. The launch is
    its own process group: at the time limit the whole group is killed, the ranks with the launcher (killing the
    launcher alone leaves its ranks running, holding the GPU while the next launch starts)."""
    cmd = ["deepspeed", "--num_gpus", str(gpus), "--master_addr", "127.0.0.1", "--master_port", str(free_port())] + script
    start = time.monotonic()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **(env or {})},
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = 124
    with open(log) as f:
        tail = "".join(f.readlines()[-15:])
    return code, tail, round(time.monotonic() - start, 1)


def run_zerotune(config: str, a: argparse.Namespace, variant: list[str] | None = None) -> dict:
    """zerotune at its defaults, or (variant = [label, key=value, ...]) an A/B row: recipe overrides,
    `ds.<path>=<json value>` edits of a copy of the DeepSpeed file, and `env.<NAME>=<value>` environment variables."""
    kind, zero = config.split("_")
    system = "zerotune" if not variant else f"zerotune:{variant[0]}"
    out = os.path.join(a.out, system.replace(":", "_") + f"_{config}")
    ds_file = f"ds_configs/{zero}.json"
    sets = (a.set or []) + [v for v in (variant or [])[1:] if not v.startswith(("ds.", "env."))]
    ds_sets = [v[3:] for v in (variant or [])[1:] if v.startswith("ds.")]
    env = dict(v[4:].split("=", 1) for v in (variant or [])[1:] if v.startswith("env."))
    if ds_sets:
        ds = json.load(open(os.path.join(ROOT, ds_file)))
        for item in ds_sets:
            path, value = item.split("=", 1)
            *parents, leaf = path.split(".")
            node = ds
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = json.loads(value)
        os.makedirs(a.out, exist_ok=True)
        ds_file = os.path.abspath(out + ".ds.json")
        json.dump(ds, open(ds_file, "w"), indent=2)
    script = ["finetune/main.py", "--deepspeed", ds_file, "--config", f"recipes/mistral7b_{kind}.yaml",
              f"model.path={a.model}", f"model.tokenizer={a.tokenizer}", f"data.path={a.data}", "data.format=text",
              "data.overlong=truncate", f"data.max_seq_len={a.seq}", f"train.micro_batch_size={ROWS}",
              "train.grad_accum=1", f"train.max_steps={a.steps}", "optim.warmup_steps=2", f"train.output_dir={out}",
              "train.overwrite=true", "train.sample_prompt=null", "train.export=false", "train.save_every=0",
              "train.log_every=1"] + sets
    code, tail, wall = launch(script, a.gpus, out + ".log", a.timeout, env)
    result = {"system": system, "config": config, "exit": code, "wall_s": wall}
    metrics = os.path.join(out, "metrics.jsonl")
    steps = [r for r in read_metrics(metrics) if "loss" in r] if os.path.exists(metrics) else []
    timed = steps[a.skip:]
    if code != 0 or not timed:
        return {**result, "error": tail}
    seconds = sum(r["step_time_s"] for r in timed)
    return {**result, "tokens_per_s_per_gpu": sum(r["tokens"] for r in timed) / seconds / a.gpus,
            "peak_mem_gib": max(r["peak_mem_gib"] for r in steps), "losses": [r["loss"] for r in steps],
            "settings": _settings(out)}


def _settings(run_dir: str) -> str:
    """What zerotune chose: checkpointing and micro-batch (recipe.yaml, as resolved), liger and the GEMMs' precision
    (speedups.json, what the run applied)."""
    import yaml

    recipe = yaml.safe_load(open(os.path.join(run_dir, "recipe.yaml")))
    ckpt = recipe["model"]["activation_checkpointing"]
    if recipe["model"].get("recompute_layers"):  # of the model's layers (config.json)
        layers = json.load(open(os.path.join(recipe["model"]["path"], "config.json")))["num_hidden_layers"]
        ckpt += f" {recipe['model']['recompute_layers']}/{layers}"
    applied = {r["name"] for r in json.load(open(os.path.join(run_dir, "speedups.json"))) if r["on"]}
    liger, fp8 = "liger" in applied, "fp8" in applied
    return (f"ckpt {ckpt}, liger {'on' if liger else 'off'}, "
            f"mbs {recipe['train']['micro_batch_size']}x{recipe['train']['grad_accum']}, {'fp8' if fp8 else 'bf16'}")


def run_peer(system: str, config: str, a: argparse.Namespace) -> dict:
    kind, zero = config.split("_")
    mbs, ga, ckpt, liger = PEER[system][config]
    out = os.path.join(a.out, f"{system}_{config}")
    script = ["benchmarks/peer_hf_trainer.py", "--model", a.model, "--zero", zero[-1], "--micro-batch", str(mbs),
              "--grad-accum", str(ga), "--checkpointing", ckpt, "--liger", liger, "--seq", str(a.seq),
              "--steps", str(a.steps), "--skip", str(a.skip), "--out", out + ".json"] + (["--lora"] if kind == "lora" else [])
    code, tail, wall = launch(script, a.gpus, out + ".log", a.timeout)
    result = {"system": system, "config": config, "exit": code, "wall_s": wall,
              "settings": f"ckpt {ckpt}, liger {liger}, mbs {mbs}x{ga}"}
    if code != 0 or not os.path.exists(out + ".json"):
        return {**result, "error": tail}
    measured = json.load(open(out + ".json"))
    result.update(tokens_per_s_per_gpu=measured["tokens_per_s_per_gpu"], peak_mem_gib=measured["peak_mem_gib"])
    callback = measured.get("step_times_callback", [])[a.skip:]
    if callback:  # the same steps timed from on_step_begin only (its data fetch and token count left out)
        tokens_per_gpu_step = measured["tokens_per_s_per_gpu"] * measured["step_time_s"]
        result["tokens_per_s_per_gpu_callback"] = tokens_per_gpu_step / (sum(callback) / len(callback))
    return result


def table(results: list[dict], seq: int = 2048, targets: dict[str, int] | None = None) -> str:
    """The markdown table; `targets` (tok/s/GPU by config) replaces TARGETS' where given."""
    targets = {**TARGETS, **(targets or {})}
    by = {(r["system"], r["config"]): r for r in results}
    lines = ["| config | system | settings | tok/s/GPU | MFU | peak GiB | zerotune / this | target |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for config in CONFIGS:
        ours = by.get(("zerotune", config), {}).get("tokens_per_s_per_gpu")
        variants = sorted(s for s, c in by if c == config and s.startswith("zerotune:"))
        for system in ["zerotune", *variants, "peer_default", "peer_best"]:
            r = by.get((system, config))
            if r is None and system == "peer_best" and PEER["peer_best"][config] == PEER["peer_default"][config]:
                r = by.get(("peer_default", config))  # its best settings are its defaults
            if r is None:
                continue
            tps = r.get("tokens_per_s_per_gpu")
            if tps is None:
                why = "out of memory" if "OutOfMemoryError" in r.get("error", "") else "failed"
                lines.append(f"| {config} | {system} | {r.get('settings', '')} | {why} (exit {r['exit']}) | | | | |")
                continue
            mfu = tps * issue_flops_per_token(seq) / (H200_TFLOPS * 1e12)
            ratio = f"{ours / tps:.2f}" if ours and system != "zerotune" else ""
            target = f"{targets[config]:,}" if system == "zerotune" else ""
            lines.append(f"| {config} | {system} | {r.get('settings', '')} | {tps:,.0f} | {mfu:.1%} | "
                         f"{r['peak_mem_gib']:.1f} | {ratio} | {target} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str, targets: dict[str, int] | None = None, gpus: int = 2, seq: int = 2048) -> None:
    """Grouped bars: tok/s/GPU of zerotune, the peer's defaults and best per configuration, the targets (TARGETS',
    replaced by `targets` where given, as in table()) as ticks."""
    targets = {**TARGETS, **(targets or {})}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["system"], r["config"]): r.get("tokens_per_s_per_gpu") or 0 for r in results}
    systems = [("peer_default", "HF Trainer + DeepSpeed, defaults", "#bbbbbb"),
               ("peer_best", "HF Trainer + DeepSpeed, best hand-tuned", "#777777"),
               ("zerotune", "zerotune, defaults", "#1f77b4")]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.27
    for i, (system, label, color) in enumerate(systems):
        # peer_best with the defaults' settings was measured once, as peer_default; a config not run draws no bar
        values = [by.get((system, c)) or (by.get(("peer_default", c)) if system == "peer_best" and
                  PEER["peer_best"][c] == PEER["peer_default"][c] else 0) or 0 for c in CONFIGS]
        bars = ax.bar([x + (i - 1) * width for x in range(len(CONFIGS))], values, width, label=label, color=color)
        ax.bar_label(bars, labels=[f"{v / 1000:.1f}K" if v else "" for v in values], fontsize=7)
    ax.scatter(range(len(CONFIGS)), [targets[c] for c in CONFIGS], marker="_", s=600, color="red", label="target")
    ax.set_xticks(range(len(CONFIGS)), [c.replace("_", ", ZeRO-")[:-5] + c[-1] for c in CONFIGS])
    ax.set_ylabel("tokens/s per GPU")
    ax.set_title(f"Mistral-7B shape, seq {seq}, {gpus} GPU(s): zerotune vs HF Trainer + DeepSpeed")
    ax.set_ylim(0, 1.3 * max([*targets.values(), *by.values()]))
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="saved Mistral-7B-shaped model folder")
    p.add_argument("--tokenizer", default="mistral-common")
    p.add_argument("--data", help="text JSONL (benchmarks/synthetic_data.py)")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--out", default="runs/vs_peer")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--systems", nargs="+", default=["zerotune", "peer_default", "peer_best"],
                   choices=["zerotune", "peer_default", "peer_best"])
    p.add_argument("--variant", nargs="+", action="append", metavar="LABEL KEY=VALUE",
                   help="also run zerotune with recipe overrides, ds.<path>=<json> DeepSpeed edits and env.<NAME>=<value> "
                        "variables, as row zerotune:LABEL (A/B experiments; repeatable)")
    p.add_argument("--set", nargs="+", metavar="KEY=VALUE",
                   help="recipe overrides for every zerotune row (e.g. model.precision=fp8); variants add theirs after")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=4)
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs already in OUT/vs_peer.json that succeeded and run only the rest (a machine "
                        "that caps each command's time runs the benchmark as the same command, repeated)")
    p.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="start no run after this many seconds (then rerun with --resume for the rest)")
    p.add_argument("--table", nargs="+", metavar="JSON", help="only merge these result files and print the table")
    p.add_argument("--plot", metavar="PNG", help="with --table: also draw the bars")
    p.add_argument("--target", nargs="+", default=[], metavar="CONFIG=TOK_S",
                   help="the table's target for a config (tok/s/GPU), e.g. lora_zero2=22000; default TARGETS")
    a = p.parse_args(argv)
    try:
        targets = {c: int(v) for c, v in (t.split("=", 1) for t in a.target)}
    except ValueError:
        p.error(f"--target takes CONFIG=TOK_S (an integer), got {' '.join(a.target)}")
    if set(targets) - set(CONFIGS):
        p.error(f"--target: unknown config {sorted(set(targets) - set(CONFIGS))}; one of {', '.join(CONFIGS)}")
    if a.table:
        merged, shape = {}, {}
        for path in a.table:
            data = json.load(open(path))
            shape = {k: data[k] for k in ("gpus", "seq") if k in data}
            for r in data["runs"]:
                merged[(r["system"], r["config"])] = r
        print(table(list(merged.values()), shape.get("seq", 2048), targets))
        if a.plot:
            plot(list(merged.values()), a.plot, targets, **shape)
        return 0
    os.makedirs(a.out, exist_ok=True)
    out_json = os.path.join(a.out, "vs_peer.json")
    results = []
    if a.resume and os.path.exists(out_json):
        results = [r for r in json.load(open(out_json))["runs"] if "tokens_per_s_per_gpu" in r]
        print(f"resuming: {len(results)} run(s) already measured in {out_json}", flush=True)
    done = {(r["system"], r["config"]) for r in results}
    started = time.monotonic()
    for config in a.configs:
        for system in a.systems:
            if system == "peer_best" and "peer_default" in a.systems and PEER["peer_best"][config] == PEER["peer_default"][config]:
                continue  # the same settings: measured once, as the default
            jobs = [(system, None)] + [(f"zerotune:{v[0]}", v) for v in (a.variant or []) if system == "zerotune"]
            for name, variant in jobs:
                if (name, config) in done:
                    continue
                if a.stop_after is not None and time.monotonic() - started > a.stop_after:
                    print(f"--stop-after {a.stop_after:g} s: {name} {config} and the runs after it are left for "
                          f"--resume", flush=True)
                    print(table(results, a.seq, targets))
                    return 3
                r = run_zerotune(config, a, variant) if system == "zerotune" else run_peer(system, config, a)
                results.append(r)
                print(f"{r['system']} {config}: " + (
                    f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, {r['peak_mem_gib']:.1f} GiB"
                    if "tokens_per_s_per_gpu" in r else f"failed, exit {r['exit']}\n{r['error']}")
                      + f" ({r['wall_s']:.0f} s; {time.monotonic() - started:.0f} s since start)", flush=True)
                with open(out_json, "w") as f:
                    json.dump({"runs": results, "seq": a.seq, "gpus": a.gpus, "steps": a.steps, "skip": a.skip,
                               "versions": versions()}, f, indent=2)
    print(table(results, a.seq, targets))
    return 0


def versions() -> dict[str, str]:
    """What the figures were measured with: the packages, the GPU and its driver."""
    from importlib import metadata

    found = {}
    for package in ("torch", "deepspeed", "transformers", "peft", "liger-kernel", "triton"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "absent"
    try:
        found["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,power.limit",
                                       "--format=csv,noheader"], capture_output=True, text=True,
                                      timeout=30).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        found["gpu"] = "unknown"
    return found


if __name__ == "__main__":
    sys.exit(main())
