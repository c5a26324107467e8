"""DPO on one GPU: zerotune against TRL's DPOTrainer + DeepSpeed ZeRO-2, on Mistral-7B's shape (random init from
recipes/mistral7b_shape, no weights), the same synthetic preference pairs, LoRA r16 on the seven projections, β 0.1.

    python benchmarks/preference.py --out runs/preference/preference.json          # on one GPU: (a), (b), (c)
    python benchmarks/preference.py --smoke --out /tmp/pref/preference.json        # the same on a CPU, tiny model
    python benchmarks/preference.py --table runs/preference/preference.json        # print the table again

The runs, each its own `deepspeed --num_gpus 1` launch (loopback rendezvous), in this order:

- lora_zero2 / zerotune: `finetune/main.py --deepspeed ds_configs/zero2.json --config recipes/mistral7b_dpo.yaml`
  with rows of data.max_seq_len 4,096 tokens (a packed row holds whole pairs, each pair's prompt once where
  train.share_prompt is on: its default on a GPU); the reference is the model with its adapters off. Nothing else
  is set beyond the work (data, steps) and quiet outputs (no export, no checkpoint).
- lora_zero2 / trl: DPOTrainer with `peft_config` (the reference is the model with its adapters off, TRL's default
  for a PEFT model), ZeRO-2, bf16, liger's layer kernels, one pair batch per step; the first of PEER_SETTINGS that
  runs is kept (the largest batch, without activation checkpointing first). TRL pads each batch to its longest
  sequence; its `padding_free` falls back to padding in this version, so it is not offered.
- full_zero3 / zerotune: full fine-tuning under ds_configs/zero3.json with train.gpu_memory_gib (the planner picks
  activation checkpointing and micro-batch); the reference is precomputed once before the first step.

pairs/s is the pairs of the steps after --skip over their summed step times (zerotune: metrics.jsonl; TRL: wall time
from one step's end to the next, as benchmarks/peer_hf_trainer.py times the Trainer); tok/s is pairs/s times the
data's mean tokens per pair, both sequences whole (prompt twice), padding not included, for every system alike
(zerotune's rows hold a pair's prompt once where train.share_prompt is on: its row tokens/s are row_tokens_per_s). The pairs are random words (write_pairs) whose lengths
are set in tokens of the real Mistral-7B tokenizer: a prompt of --prompt-tokens and responses of about
--response-tokens, so a sequence is about 1,024 tokens and two pairs fill a 4,096-token row.

Every run draws its own random init from config.json, unless --saved-init DIR saves one (once, on the GPU) and every
run loads it: zerotune draws a model built from config.json alone on the CPU under ZeRO-0/1/2 (the same weights on
every stage), which for 7B parameters delays the first step (docs/benchmarks/2026-12-03-h200-preference.md).
Each result is written to --out as soon as its run ends, with the log's tail when it failed; a launch past
--run-timeout is killed with its ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.long_context import _plan  # noqa: E402
from benchmarks.vs_peer import launch, versions  # noqa: E402
from finetune.run.metrics import read_metrics  # noqa: E402

WORDS = ("model data train step loss token batch layer rank shard memory gradient weight bias norm attention "
         "query key value head window sequence packing sample epoch optimizer state bucket stage offload node "
         "host slot port cache prefix adapter merge export resume checkpoint metric tensor kernel fused answer "
         "question reason result number river mountain city garden letter window music paper story").split()
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
# TRL's settings, tried in order until one runs: (pairs per step, activation checkpointing, liger layer kernels)
PEER_SETTINGS = ((8, "off", "on"), (4, "off", "on"), (8, "on", "on"))
LORA_KEY, FULL_KEY = ("lora_zero2", "zerotune"), ("full_zero3", "zerotune")
LORA_PRE_KEY = ("lora_zero2", "zerotune, precomputed reference")
PEER_KEY = ("lora_zero2", "trl")
TARGET = 1.5  # zerotune's LoRA DPO pairs/s over TRL's that the table marks


# --- the pairs ------------------------------------------------------------------------------------------------

def _words_for(tokens: int, rng: random.Random, cost: dict[str, int]) -> str:
    """Random words whose encodings add up to `tokens` tokens (each word's count as the tokenizer gives it alone)."""
    out, n = [], 0
    while n < tokens:
        word = rng.choice(WORDS)
        if n + cost[word] > tokens:
            word = min(WORDS, key=cost.get)
        out.append(word)
        n += cost[word]
    return " ".join(out)


def write_pairs(path: str, n: int, prompt_tokens: int, response_tokens: int, seed: int = 0,
                tokenizer: str = "mistral-common") -> dict:
    """Write `n` pairs {"prompt", "chosen", "rejected"} of random words to `path` (JSONL): a prompt of about
    `prompt_tokens` tokens, responses of `response_tokens` give or take a sixteenth. Returns their lengths as the
    zerotune preference format encodes them (each sequence: BOS, [INST] prompt [/INST], response, EOS)."""
    from finetune.data.registry import Encoder, get_format
    from finetune.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    cost = {w: len(tok.encode(w)) for w in WORDS}
    rng = random.Random(seed)
    spread = max(1, response_tokens // 16)
    encode = get_format("preference")
    lengths = []
    with open(path, "w") as f:
        for _ in range(n):
            record = {"prompt": _words_for(prompt_tokens, rng, cost),
                      "chosen": _words_for(response_tokens + rng.randint(-spread, 0), rng, cost),
                      "rejected": _words_for(response_tokens + rng.randint(-spread, 0), rng, cost)}
            pair = encode(record, Encoder(tok))
            lengths.append((len(pair.chosen.input_ids), len(pair.rejected.input_ids)))
            f.write(json.dumps(record) + "\n")
    seqs = [x for pair in lengths for x in pair]
    return {"pairs": n, "sequence_tokens_min": min(seqs), "sequence_tokens_max": max(seqs),
            "sequence_tokens_mean": sum(seqs) / len(seqs), "pair_tokens_mean": sum(seqs) / n,
            "pair_tokens_max": max(c + r for c, r in lengths)}


# --- the runs ---------------------------------------------------------------------------------------------------

def save_init(config_dir: str, dest: str) -> str:
    """A random init of the model in `config_dir` saved to `dest` (bf16, built on the GPU; fp32 on a CPU), in a
    process of its own so that this one holds no GPU memory; kept when `dest` already holds one."""
    if not os.path.exists(os.path.join(dest, "config.json")):
        subprocess.run([sys.executable, os.path.abspath(__file__), "init", config_dir, dest], check=True, cwd=ROOT)
    return dest


def _init_main(config_dir: str, dest: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    gpu = torch.cuda.is_available()
    with torch.device("cuda" if gpu else "cpu"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir),
                                                 dtype=torch.bfloat16 if gpu else torch.float32)
    model.save_pretrained(dest)


def _ran_out(code: int, tail: str) -> str:
    if code == 124:
        return "time limit"
    if "out of memory" in tail.lower() or "OutOfMemoryError" in tail:
        return "out of memory"
    return f"exit {code}"


def run_zerotune(key: tuple[str, str], folder: str, pairs: str, ds: str, sets: list[str], steps: int, skip: int,
                 timeout: int, a: argparse.Namespace) -> dict:
    """One zerotune run (recipes/mistral7b_dpo.yaml and `sets`) of `steps` steps on the pairs named `pairs` ("lora"
    or "full"), in the work folder's `folder`; pairs/s, tok/s and the peak from its metrics.jsonl, the steps after
    `skip`."""
    config, system = key
    out = os.path.join(a.workdir, folder)
    script = ["finetune/main.py", "--deepspeed", ds, "--config", "recipes/mistral7b_dpo.yaml",
              f"data.path={a.pair_files[pairs]}",
              f"model.path={a.model}", "model.tokenizer=mistral-common", f"data.max_seq_len={a.max_seq_len}",
              f"train.max_steps={steps}", "optim.warmup_steps=2", f"train.output_dir={out}", "train.overwrite=true",
              "train.export=false", "train.save_every=0", "train.eval_every=0", "train.log_every=1",
              "train.sample_prompt=null", *sets]
    code, tail, wall = launch(script, 1, out + ".log", timeout, a.env)
    result = {"config": config, "system": system, "exit": code, "wall_s": wall,
              "command": "deepspeed --num_gpus 1 " + " ".join(script)}
    metrics = os.path.join(out, "metrics.jsonl")
    steps_done = [r for r in read_metrics(metrics) if "loss" in r] if os.path.exists(metrics) else []
    timed = steps_done[skip:]
    if code != 0 or len(steps_done) < steps or not timed:
        return {**result, "error": _ran_out(code, tail), "log_tail": tail}
    seconds = sum(r["step_time_s"] for r in timed)
    pairs_per_s = sum(r["pairs"] for r in timed) / seconds
    # tok/s as TRL's is counted: both sequences of each pair whole (the prompt twice), whatever the rows hold
    return {**result, "pairs_per_s": pairs_per_s, "tokens_per_s": pairs_per_s * a.pair_tokens[pairs],
            "row_tokens_per_s": sum(r["tokens"] for r in timed) / seconds, "step_time_s": seconds / len(timed),
            "pairs_per_step": sum(r["pairs"] for r in timed) / len(timed),
            "peak_mem_gib": max(r["peak_mem_gib"] for r in steps_done), "losses": [r["loss"] for r in steps_done],
            "reward_accuracy": [r.get("accuracy") for r in steps_done], "settings": _settings(out),
            "plan": _plan(out + ".log")}


def _settings(run_dir: str) -> str:
    """What zerotune ran with, as resolved: activation checkpointing, micro-batch, reference, speed-ups on."""
    import yaml

    recipe = yaml.safe_load(open(os.path.join(run_dir, "recipe.yaml")))
    ckpt = recipe["model"]["activation_checkpointing"]
    if recipe["model"].get("recompute_layers"):
        ckpt += f" {recipe['model']['recompute_layers']} layers"
    on = []
    speedups = os.path.join(run_dir, "speedups.json")
    if os.path.exists(speedups):
        on = [s["name"] for s in json.load(open(speedups)) if s.get("on")]
    t = recipe["train"]
    reference = t["reference"] if t["reference"] != "auto" else (
        "adapters_off" if recipe["lora"]["enabled"] else "precomputed")
    return (f"ckpt {ckpt}, rows {t['micro_batch_size']}x{t['grad_accum']} of {recipe['data']['max_seq_len']}, "
            f"reference {reference}, on: {', '.join(on) or 'none'}")


def run_peer(a: argparse.Namespace, deadline: float) -> list[dict]:
    """TRL's DPOTrainer at each of PEER_SETTINGS until one runs (each try a result; the last is the one shown)."""
    tries = []
    for batch, ckpt, liger in a.peer_settings:
        left = deadline - time.monotonic()
        if tries and left < a.min_run_s:
            break
        out = os.path.join(a.workdir, f"trl_b{batch}_ckpt{ckpt}_liger{liger}")
        script = ["benchmarks/preference.py", "peer", "--model", a.model, "--tokenizer", a.tokenizer_dir,
                  "--data", a.data, "--batch", str(batch), "--checkpointing", ckpt, "--liger", liger,
                  "--steps", str(a.steps), "--skip", str(a.skip), "--out", out + ".json"]
        code, tail, wall = launch(script, 1, out + ".log", int(min(a.run_timeout, left)), a.env)
        result = {"config": PEER_KEY[0], "system": PEER_KEY[1], "exit": code, "wall_s": wall,
                  "settings": f"ckpt {ckpt}, liger {liger}, {batch} pairs per step, padded",
                  "command": "deepspeed --num_gpus 1 " + " ".join(script)}
        if code == 0 and os.path.exists(out + ".json"):
            measured = json.load(open(out + ".json"))
            tries.append({**result, **{k: measured[k] for k in (
                "pairs_per_s", "tokens_per_s", "step_time_s", "pairs_per_step", "peak_mem_gib", "losses",
                "tokens_per_pair", "padded_tokens_per_pair", "step_times")}})
            break
        tries.append({**result, "error": _ran_out(code, tail), "log_tail": tail})
    return tries


# --- TRL's side, one launch ----------------------------------------------------------------------------------------

def peer_main(argv: list[str]) -> None:
    """TRL's DPOTrainer on the pairs (launched by run_peer through `deepspeed`); rank 0 writes --out."""
    p = argparse.ArgumentParser(prog="preference.py peer")
    p.add_argument("--model", required=True, help="a folder with config.json (random init, bf16 on a GPU)")
    p.add_argument("--tokenizer", required=True, help="a folder AutoTokenizer loads")
    p.add_argument("--data", required=True)
    p.add_argument("--batch", type=int, required=True, help="pairs per step")
    p.add_argument("--checkpointing", choices=("on", "off"), required=True)
    p.add_argument("--liger", choices=("on", "off"), required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--skip", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", "--local-rank", type=int, default=0)
    args = p.parse_args(argv)

    import tempfile

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from benchmarks.peer_hf_trainer import StepClock, ds_config

    gpu = torch.cuda.is_available()
    # the config first: with DeepSpeed it sets up the process group and the accelerator state
    config = DPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_dpo_"), per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=5e-6, warmup_steps=2, weight_decay=0.0,
        bf16=gpu, gradient_checkpointing=args.checkpointing == "on",
        gradient_checkpointing_kwargs={"use_reentrant": False}, use_liger_kernel=args.liger == "on",
        deepspeed=ds_config(2), beta=0.1, loss_type=["sigmoid"], max_length=None, logging_steps=1,
        save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0, use_cpu=not gpu, seed=0)
    dtype = torch.bfloat16 if gpu else torch.float32
    if any(name.endswith(".safetensors") for name in os.listdir(args.model)):  # a saved init (--saved-init)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
    else:
        with torch.device("cuda" if gpu else "cpu"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model), dtype=dtype,
                                                     attn_implementation="sdpa")
    model.config.use_cache = False
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    with open(args.data) as f:
        records = [json.loads(line) for line in f]
    # the text the Mistral template makes of a prompt and its responses (TRL adds BOS and EOS)
    data = Dataset.from_list([{"prompt": f"[INST] {r['prompt']} [/INST]", "chosen": " " + r["chosen"],
                               "rejected": " " + r["rejected"]} for r in records])
    clock = StepClock()

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            if gpu:
                torch.cuda.synchronize()
            clock.begin(time.perf_counter())

        def on_step_end(self, *_, **__):
            if gpu:
                torch.cuda.synchronize()
            clock.end(time.perf_counter())

    trainer = DPOTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                         peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA), callbacks=[Timer()])
    prepared = trainer.train_dataset
    per_pair = [2 * len(p_) + len(c) + len(r) for p_, c, r in
                zip(prepared["prompt_ids"], prepared["chosen_ids"], prepared["rejected_ids"])]
    trainer.train()
    if int(os.environ.get("RANK", "0")) != 0:
        return
    kept = clock.times[args.skip:]
    step_time = sum(kept) / len(kept)
    tokens_per_pair = sum(per_pair) / len(per_pair)
    padded = _padded_tokens_per_pair(prepared, args.batch, args.steps)
    peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else None
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    with open(args.out, "w") as f:
        json.dump({"step_times": clock.times, "step_time_s": step_time, "pairs_per_step": args.batch,
                   "pairs_per_s": args.batch / step_time, "tokens_per_s": args.batch / step_time * tokens_per_pair,
                   "tokens_per_pair": tokens_per_pair, "padded_tokens_per_pair": padded, "peak_mem_gib": peak,
                   "losses": losses, "args": vars(args)}, f, indent=2)


def _padded_tokens_per_pair(prepared, batch: int, steps: int) -> float:
    """Tokens per pair as TRL's batches hold them: 2 x batch sequences padded to the longest (in dataset order;
    the sampler shuffles, which changes little when the lengths are close)."""
    lengths = [(len(p) + len(c), len(p) + len(r)) for p, c, r in
               zip(prepared["prompt_ids"], prepared["chosen_ids"], prepared["rejected_ids"])]
    total, pairs = 0, 0
    for start in range(0, min(len(lengths), batch * steps), batch):
        group = lengths[start:start + batch]
        total += 2 * len(group) * max(max(pair) for pair in group)
        pairs += len(group)
    return total / max(pairs, 1)


# --- the table ---------------------------------------------------------------------------------------------------

def shown(results: list[dict]) -> dict[tuple[str, str], dict]:
    """The row of each (config, system): the last try (TRL's first settings that ran, or its last failure)."""
    return {(r["config"], r["system"]): r for r in results}


def table(results: list[dict]) -> str:
    rows = shown(results)
    peer = rows.get(PEER_KEY, {}).get("pairs_per_s")
    lines = ["| config | system | settings | pairs/s | tok/s | peak GiB | vs TRL |",
             "|---|---|---|---:|---:|---:|---:|"]
    for key in (LORA_KEY, LORA_PRE_KEY, PEER_KEY, FULL_KEY):
        r = rows.get(key)
        if r is None:
            continue
        if "pairs_per_s" not in r:
            lines.append(f"| {key[0]} | {key[1]} | {r.get('settings', '')} | failed ({r['error']}) | | | |")
            continue
        ratio = f"{r['pairs_per_s'] / peer:.2f}" if peer and key != PEER_KEY else ""
        peak = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "n/a"
        lines.append(f"| {key[0]} | {key[1]} | {r.get('settings', '')} | {r['pairs_per_s']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {peak} | {ratio} |")
    ours = rows.get(LORA_KEY, {}).get("pairs_per_s")
    if ours and peer:
        verdict = "met" if ours / peer >= TARGET else "not met"
        lines.append(f"\nLoRA DPO, zerotune / TRL: {ours / peer:.2f}x pairs/s (target {TARGET}x: {verdict})")
    return "\n".join(lines)


# --- main ----------------------------------------------------------------------------------------------------------

def _environment(smoke: bool) -> dict[str, str]:
    """Loopback rendezvous; under --smoke CPU-only ranks (DeepSpeed's CPU accelerator, as the CPU tests run)."""
    env = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    if smoke:
        cpu_only = os.path.join(ROOT, "tests", "fixtures", "cpu_only")
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join((cpu_only, env["PYTHONPATH"])),
                   PATH=os.pathsep.join((os.path.dirname(sys.executable), os.environ.get("PATH", ""))))
    return env


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "peer" in argv[:2]:  # the launcher puts --local_rank=0 first
        peer_main([x for x in argv if x != "peer"])
        return 0
    if argv[:1] == ["init"]:
        _init_main(*argv[1:3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/preference/preference.json", help="the results JSON")
    p.add_argument("--smoke", action="store_true", help="a CPU check of the whole path: tiny model, short pairs")
    p.add_argument("--runs", nargs="+", default=["lora", "peer", "full"], choices=["lora", "lora_pre", "peer", "full"],
                   help="lora_pre: zerotune's LoRA DPO with train.reference=precomputed (scored before the first "
                        "step, outside the step times)")
    p.add_argument("--pairs", type=int, default=128, help="pairs in the LoRA runs' data")
    p.add_argument("--full-pairs", type=int, default=56, help="pairs in the full run's data (its reference is "
                                                               "precomputed over all of them)")
    p.add_argument("--prompt-tokens", type=int, default=496)
    p.add_argument("--response-tokens", type=int, default=504)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=3, help="steps left out of the averages (warm-up)")
    p.add_argument("--full-steps", type=int, default=6)
    p.add_argument("--full-skip", type=int, default=2)
    p.add_argument("--gpu-memory-gib", type=float, default=139.0, help="train.gpu_memory_gib of the full run")
    p.add_argument("--saved-init", metavar="DIR",
                   help="save one random init of the shape here (once) and load it in every run; without it each "
                        "run draws its own from config.json, which under ZeRO-2 zerotune does on the CPU")
    p.add_argument("--run-timeout", type=int, default=240, help="seconds per launch at most")
    p.add_argument("--budget", type=float, default=540, help="seconds for everything; no launch starts after it")
    p.add_argument("--min-run-s", type=float, default=90, help="a further TRL try needs this much of the budget")
    p.add_argument("--table", metavar="JSON", help="only print the table of this results file")
    a = p.parse_args(argv)
    if a.table:
        print(table(json.load(open(a.table))["runs"]))
        return 0
    started = time.monotonic()
    deadline = started + a.budget
    a.peer_settings = PEER_SETTINGS
    a.model, a.max_seq_len = "recipes/mistral7b_shape", 4096
    lora_ds, full_ds, full_sets = "ds_configs/zero2.json", "ds_configs/zero3.json", [
        f"train.gpu_memory_gib={a.gpu_memory_gib:g}"]
    if a.smoke:  # the tiny Mistral on a CPU: fp32 (DeepSpeed's CPU accelerator), rows of 256 tokens
        a.model, a.max_seq_len = "recipes/tiny_model", 256
        a.prompt_tokens, a.response_tokens, a.pairs, a.full_pairs = 24, 24, 24, 12
        a.steps, a.skip, a.full_steps, a.full_skip = 4, 1, 3, 1
        a.peer_settings = ((4, "off", "off"),)
        lora_ds, full_ds, full_sets = "ds_configs/zero3_fp32.json", "ds_configs/zero3_fp32.json", []
    a.env = _environment(a.smoke)
    if a.saved_init:
        a.model = save_init(a.model, os.path.abspath(a.saved_init))
    a.workdir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(a.workdir, exist_ok=True)
    from finetune.data.tokenizer import builtin_tokenizer_dir

    a.tokenizer_dir = builtin_tokenizer_dir(os.path.join(a.workdir, "tokenizer"))
    a.data = os.path.join(a.workdir, "pairs.jsonl")
    full_data = os.path.join(a.workdir, "pairs_full.jsonl")
    data = {"lora": write_pairs(a.data, a.pairs, a.prompt_tokens, a.response_tokens),
            "full": write_pairs(full_data, a.full_pairs, a.prompt_tokens, a.response_tokens, seed=1)}
    a.pair_files = {"lora": a.data, "full": full_data}
    a.pair_tokens = {name: lengths["pair_tokens_mean"] for name, lengths in data.items()}
    print(f"pairs: {json.dumps(data)}", flush=True)
    results: list[dict] = []

    def save() -> None:
        with open(a.out, "w") as f:
            json.dump({"runs": results, "data": data, "model": a.model, "steps": a.steps, "skip": a.skip, "full_steps": a.full_steps,
                       "full_skip": a.full_skip, "max_seq_len": a.max_seq_len, "smoke": a.smoke,
                       "versions": {**versions(), **_more_versions()}}, f, indent=2)

    def report(r: dict) -> None:
        results.append(r)
        save()
        what = (f"{r['pairs_per_s']:.2f} pairs/s, {r['tokens_per_s']:,.0f} tok/s, peak {r['peak_mem_gib']} GiB"
                if "pairs_per_s" in r else f"failed ({r['error']})\n{r.get('log_tail', '')}")
        print(f"{r['config']} {r['system']} [{r.get('settings', '')}]: {what} ({r['wall_s']:.0f} s; "
              f"{time.monotonic() - started:.0f} s since start)", flush=True)

    def timeout() -> int:
        return int(max(1, min(a.run_timeout, deadline - time.monotonic())))

    for run in a.runs:
        if time.monotonic() > deadline - 30:
            print(f"--budget {a.budget:g} s spent: {run} not started", flush=True)
            break
        if run == "lora":
            report(run_zerotune(LORA_KEY, "zerotune_lora_zero2", "lora", lora_ds, [], a.steps, a.skip, timeout(), a))
        elif run == "lora_pre":
            report(run_zerotune(LORA_PRE_KEY, "zerotune_lora_zero2_precomputed", "lora", lora_ds,
                                ["train.reference=precomputed"], a.steps, a.skip, timeout(), a))
        elif run == "peer":
            for r in run_peer(a, deadline):
                report(r)
        else:
            report(run_zerotune(FULL_KEY, "zerotune_full_zero3", "full", full_ds, ["lora.enabled=false", *full_sets],
                                a.full_steps, a.full_skip, timeout(), a))
    save()
    print(table(results), flush=True)
    return 0


def _more_versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for package in ("trl", "datasets", "accelerate"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "absent"
    return found


if __name__ == "__main__":
    sys.exit(main())
