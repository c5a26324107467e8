"""A data error through the real `deepspeed` launcher on 2 ranks: one `zerotune: error: FILE:LINE: ...` line, exit
code 2, no traceback, and the run folder as it was, so the same command trains once the file is fixed. Its unit half
(readers, messages, the cache left as it was): tests/unit/test_data_input.py."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.helpers import ROOT, SMALL_VOCAB, TINY_RECIPE, deepspeed_command, ds_variant, free_port, loopback_env

GOOD = [{"instruction": "Say hi.", "output": "Hi!"}, {"instruction": "Name a colour.", "output": "Blue."}]


def launch(out, data: str, ds: str) -> subprocess.CompletedProcess:
    # the tiny model with the small vocabulary (config.json and tokenizer, seeded random init)
    cmd = [*deepspeed_command(), "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           "finetune/main.py", "--deepspeed", ds, "--config", TINY_RECIPE, f"model.path={SMALL_VOCAB}",
           f"model.tokenizer={SMALL_VOCAB}", f"data.path={data}", "data.max_seq_len=64", "train.max_steps=2",
           "train.sample_prompt=null", "train.export=false", f"train.output_dir={out}"]
    return subprocess.run(cmd, cwd=ROOT, env=loopback_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same command twice: with a malformed line 3, then with that line fixed."""
    tmp = tmp_path_factory.mktemp("data_errors")
    ds = ds_variant("zero2", str(tmp / "zero2_fp32.json"), bf16=False)
    data, out = tmp / "train.jsonl", tmp / "run"
    out.mkdir()  # an empty folder made for the run: it must stay as it is
    lines = [json.dumps(r) for r in GOOD]
    data.write_text("\n".join([*lines, '{"instruction": "Count to two.", "output": "1, 2"']) + "\n")
    failed = launch(out, str(data), ds)
    after_failure = sorted(os.listdir(out))
    data.write_text("\n".join([*lines, '{"instruction": "Count to two.", "output": "1, 2"}']) + "\n")
    fixed = launch(out, str(data), ds)
    return data, out, failed, after_failure, fixed


def test_a_malformed_line_is_one_error_naming_file_and_line(runs):
    data, _, failed, _, _ = runs
    output = failed.stdout + failed.stderr
    assert failed.returncode == 2, output[-6000:]
    errors = [line for line in output.splitlines() if "zerotune: error:" in line]
    assert len(errors) == 1, output[-6000:]
    assert errors == [f"zerotune: error: {data}:3: the line is cut short: its JSON record stops at column 49 before "
                      f"it is complete (a file truncated mid-record?); complete the record or remove that line"]
    assert "Traceback" not in output, output[-6000:]


def test_a_failed_start_leaves_the_folder_as_it_was(runs):
    _, _, _, after_failure, _ = runs
    assert after_failure == []


def test_the_same_command_trains_once_the_file_is_fixed(runs):
    _, out, _, _, fixed = runs
    assert fixed.returncode == 0, (fixed.stdout + fixed.stderr)[-6000:]
    steps = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    assert steps == [1, 2]
    assert (out / "recipe.yaml").exists() and (out / ".cache").is_dir()
