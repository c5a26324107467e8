"""The tiny recipe's shape end to end: the partitioned ZeRO-3 load (no rank holds the whole model), and the mandated
Mistral-7B command line through the real `deepspeed` launcher stopping with a useful message, printed once. The
quickstart itself (launch/quickstart.sh, all its steps) runs in tests/integration/test_docs_commands.py."""

import json
import os
import subprocess

import pytest

from tests.helpers import (ROOT, TINY_CONFIG, deepspeed_command, free_port, loopback_env, run_ranks,
                           save_tiny_model)


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
    assert proc.stderr.count("zerotune: error:") == 1, proc.stderr  # 8 ranks meet it, local rank 0 prints it
    assert "model.path 'models/Mistral-7B-v0.1' does not exist" in proc.stderr
    assert "model.path=/path/to/Mistral-7B-v0.1" in proc.stderr
    assert not os.path.exists(os.path.join(ROOT, "runs", "mistral7b-lora", "metrics.jsonl"))
