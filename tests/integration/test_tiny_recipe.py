"""End to end through the real `deepspeed` launcher: the README's quickstart (tiny recipe, ZeRO-3, 2 ranks, loopback),
the partitioned ZeRO-3 load, and the mandated Mistral-7B command line stopping with a useful message."""

import difflib
import json
import os
import subprocess
import sys

import pytest

from finetune.ds_config import quickstart_ds_config
from tests.helpers import (ROOT, TINY_CONFIG, TINY_RECIPE, deepspeed_command, free_port, loopback_env, run_ranks,
                           save_tiny_model)


def ranks_quickstart_ds_config() -> str:
    """quickstart_ds_config() as launch/quickstart.sh asks it: in the ranks' environment, which is CPU-only here
    (loopback_env) also on a GPU machine, where this process would answer for the GPU."""
    code = f"from {quickstart_ds_config.__module__} import quickstart_ds_config; print(quickstart_ds_config())"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=loopback_env(), capture_output=True, text=True,
                          timeout=120, check=True).stdout.strip()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "run"
    proc = run_ranks(2, "finetune/main.py", ["--deepspeed", ranks_quickstart_ds_config(), "--config", TINY_RECIPE,
                                             f"train.output_dir={out}"], timeout=1800, launcher=True)
    return out, proc


def test_tiny_recipe_learns(tiny_run):
    out, _ = tiny_run
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 121))
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "peak_mem_gib"):
        assert all(r[key] is not None for r in steps), key
    first = sum(r["loss"] for r in steps[:5]) / 5
    last = sum(r["loss"] for r in steps[-5:]) / 5
    assert last < first / 5, (first, last)


def test_tiny_recipe_answers_better_after_training(tiny_run):
    out, proc = tiny_run
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    before, after = samples[0], samples[-1]
    assert (before["step"], after["step"]) == (0, 120)
    bundled = next(json.loads(line)["output"] for line in open(os.path.join(ROOT, "recipes", "data", "tiny_instruct.jsonl"))
                   if json.loads(line)["instruction"] == after["prompt"])
    score = lambda text: difflib.SequenceMatcher(None, text.split(), bundled.split()).ratio()
    assert score(after["answer"]) > 0.8 > score(before["answer"]) + 0.5, (before["answer"], after["answer"])
    assert "sample at step 120" in proc.stdout + proc.stderr


def test_tiny_run_writes_resolved_configs(tiny_run):
    out, _ = tiny_run
    ds = json.load(open(out / "ds_config.json"))
    assert ds["train_batch_size"] == 2 and ds["train_micro_batch_size_per_gpu"] == 1
    assert ds["optimizer"]["params"]["lr"] == 5e-3 and ds["gradient_clipping"] == 1.0
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 1280  # 10 x hidden
    assert '"auto"' not in json.dumps(ds)
    assert "train:" in (out / "recipe.yaml").read_text()


def test_zero3_load_is_partitioned(tmp_path):
    model_dir = save_tiny_model(str(tmp_path / "model"), config_dir=os.path.dirname(TINY_CONFIG))  # 32,000 tokens
    run_ranks(2, os.path.join(ROOT, "tests", "drivers", "zero3_probe.py"), [model_dir, str(tmp_path / "probe")], timeout=300)
    reports = [json.load(open(tmp_path / f"probe.{rank}.json")) for rank in (0, 1)]
    total = reports[0]["total"]
    assert total > 8_000_000
    for report in reports:
        assert report["resident"] == pytest.approx(total / 2, rel=0.01), report


def test_mandated_command_stops_with_model_path_advice(tmp_path):
    """`deepspeed --num_gpus 8 finetune/main.py --deepspeed ds_configs/zero3.json` with no Mistral-7B here."""
    cmd = [*deepspeed_command(), "--num_gpus", "8", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "finetune/main.py", "--deepspeed", "ds_configs/zero3.json"]
    proc = subprocess.run(cmd, cwd=ROOT, env=loopback_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "model.path 'models/Mistral-7B-v0.1' does not exist" in proc.stderr
    assert "model.path=/path/to/Mistral-7B-v0.1" in proc.stderr
    assert not os.path.exists(os.path.join(ROOT, "runs", "mistral7b-lora", "metrics.jsonl"))


def test_cpu_run_leaves_no_shared_memory_behind(tiny_run):
    """DeepSpeed's CPU shm all-reduce never unlinks its 66 MB per-rank workspace; before dist.init unlinked it, every
    CPU run left two in /dev/shm (RAM) and a day of test runs filled it (20 GB seen on this machine)."""
    _, proc = tiny_run
    assert "shm_comm" in proc.stdout + proc.stderr and "built successfully" in proc.stdout + proc.stderr  # the op ran
    port = proc.args[proc.args.index("--master_port") + 1]
    leftovers = [name for name in os.listdir("/dev/shm") if name.startswith("deepspeed_allreduce_buffer_")
                 and f"_127.0.0.1_{port}_" in name]
    assert leftovers == []
