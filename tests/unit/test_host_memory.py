"""A run that this host's memory cannot hold stops before it loads anything (finetune/memory/host.py, called by
finetune/prepare.py before the run folder is made or locked): one `zerotune: error:` line, exit 2, in seconds, the
output folder as it was. Full bf16 fine-tuning of Mistral-7B (the shipped mistral7b_full recipe on the real 7B shape,
config only) needs over 100 GiB of host memory without a GPU; LoRA fits where full does not.

The end-to-end cases run finetune/main.py as a user does, on this machine, under an address-space limit far below a
7B model: should the check ever let such a run through, it fails at its first large allocation instead of filling
the host."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import pytest

from finetune.config import ConfigError, load_recipe
from finetune.ds_config import resolve_ds_config
from finetune.memory import host
from finetune.memory.node import host_memory
from finetune.memory.estimate import GIB, estimate_run
from tests.fixtures.model_shapes import MISTRAL
from tests.helpers import ROOT, loopback_env

SHAPE = os.path.join(ROOT, "recipes", "mistral7b_shape")  # Mistral-7B's config.json, no weights
DATA = os.path.join(ROOT, "recipes", "data", "tiny_instruct.jsonl")
ADDRESS_SPACE = 8 * GIB  # the refused run imports torch and reads a config: far less; a 7B model: far more


def _recipe(kind: str, *extra: str):
    return load_recipe(os.path.join(ROOT, "recipes", f"mistral7b_{kind}.yaml"),
                       [f"model.path={SHAPE}", "model.activation_checkpointing=none", *extra])


def _ds(recipe, name: str, world: int) -> dict:
    return resolve_ds_config(name, recipe, world, MISTRAL["hidden_size"], vocab_size=MISTRAL["vocab_size"])


def _row(kind: str, name: str, world: int, *extra: str) -> dict:
    recipe = _recipe(kind, *extra)
    return estimate_run(MISTRAL, recipe, _ds(recipe, name, world), world)


# --- what a rank holds ------------------------------------------------------------------------------------------------

def test_without_a_gpu_a_rank_holds_its_share_of_every_state():
    """16 bytes per parameter for full bf16 Adam (weights 2, gradients 2, fp32 master and moments 12): all of it on
    one rank; ZeRO-3 over 4 ranks, a quarter each; ZeRO-2 keeps the whole weights on every rank (2 + 14 / 4)."""
    params = _row("full", "zero3", 1)["parameters"]
    assert host.host_bytes(_row("full", "zero3", 1), on_gpu=False) == 16 * params
    assert abs(host.host_bytes(_row("full", "zero3", 4), on_gpu=False) - 4 * params) <= 64
    assert abs(host.host_bytes(_row("full", "zero2", 4), on_gpu=False) - 5.5 * params) <= 64
    lora = _row("lora", "zero2", 1)
    assert 2 * params < host.host_bytes(lora, on_gpu=False) < 2.1 * params  # the frozen base, and small adapters


def test_with_a_gpu_a_rank_holds_the_loaded_model_unless_zero3_or_what_it_offloads():
    params = _row("full", "zero2", 8)["parameters"]
    assert host.host_bytes(_row("full", "zero2", 8), on_gpu=True) == 2 * params  # all of it, before it moves
    assert host.host_bytes(_row("full", "zero0", 8), on_gpu=True) == 4 * params  # ZeRO-0 keeps fp32 weights
    assert host.host_bytes(_row("full", "zero3", 8), on_gpu=True) == 0  # zero.Init builds each shard on the GPU
    offload = _row("full", "zero3_offload", 8)
    assert host.host_bytes(offload, on_gpu=True) == offload["cpu_states"] > 0


# --- the check --------------------------------------------------------------------------------------------------------

def _check(kind: str, name: str, world: int, on_gpu: bool, gib: float, *extra: str) -> None:
    recipe = _recipe(kind, f"train.cpu_memory_gib={gib}", *extra)
    host.check_host_fits(recipe, MISTRAL, _ds(recipe, name, world), world, on_gpu=on_gpu)


def test_a_full_fine_tune_without_a_gpu_is_refused_with_what_to_do(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError) as e:
        _check("full", "zero3", 1, False, 24)
    message = str(e.value)
    assert message.startswith(f"full fine-tuning of mistral model {SHAPE!r} (7.24B parameters) without a GPU needs at "
                              f"least 108 GiB of this host's memory (1 rank x 108 GiB: weights 13.5, gradients 13.5, "
                              f"optimizer state 80.9 GiB under ZeRO-3), but this host has 24.0 GiB: ")
    assert "train LoRA instead (lora.enabled=true: at least 14.1 GiB here)" in message
    assert "train on a machine with GPUs" in message and message.endswith("set train.cpu_memory_gib")
    assert "\n" not in message
    _check("full", "zero3", 1, False, 120)  # train.cpu_memory_gib: a host that has the memory runs
    _check("lora", "zero3", 1, False, 24)  # and LoRA fits where full does not


def test_every_rank_of_the_host_counts(monkeypatch):
    """8 ranks on one GPU host each build the whole bf16 model in host memory before ZeRO-2 moves it: 8 x 13.5 GiB."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match=r"needs at least 108 GiB of this host's memory while loading \(8 ranks x "
                                          r"13.5 GiB: every rank builds the whole model in host memory before ZeRO-2 "
                                          r"moves it to its GPU\), but this host has 64.0 GiB: use ZeRO-3"):
        _check("full", "zero2", 8, True, 64)
    _check("full", "zero3", 8, True, 64)  # zero.Init: nothing of it stays on the host
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # the other 4 ranks on another host
    _check("full", "zero2", 8, True, 64)


def test_more_than_is_free_now_is_a_warning(monkeypatch, capsys):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(host, "host_memory", lambda: (24 * GIB, 10 * GIB))
    _check("lora", "zero3", 1, False, 24)
    assert capsys.readouterr().out == ("warning: the run's 1 rank on this host need at least 14.1 GiB of its memory "
                                       "and only 10.0 GiB is available now (of 24.0): other processes may have to go, "
                                       "or the run will swap or be killed\n")


# --- end to end: finetune/main.py on this machine ---------------------------------------------------------------------

def _snapshot(folder: str) -> dict | None:
    """Every entry under `folder` with its bytes (files) and modification time (folders too: a lock file made and
    removed again changes its folder's), or None when it does not exist."""
    if not os.path.lexists(folder):
        return None
    out = {".": os.stat(folder).st_mtime_ns}
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            out[os.path.relpath(os.path.join(root, name), folder)] = os.stat(os.path.join(root, name)).st_mtime_ns
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = (f.read(), os.stat(path).st_mtime_ns)
    return out


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


@pytest.mark.parametrize("memory", ["this host's", "train.cpu_memory_gib=24"])
@pytest.mark.parametrize("folder", ["absent", "an earlier run's"])
def test_a_run_the_host_cannot_hold_stops_at_once_leaving_the_folder(tmp_path, memory, folder):
    """The user's command: full bf16 fine-tuning of Mistral-7B on this CPU machine."""
    overrides = [] if memory == "this host's" else [memory]
    if not overrides and host_memory()[0] >= 108 * GIB:
        pytest.skip("this host has the memory a full 7B fine-tune needs: the train.cpu_memory_gib case checks it")
    out = tmp_path / "run"
    if folder != "absent":
        (out / "checkpoints").mkdir(parents=True)
        (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    before = _snapshot(str(out))
    cmd = [sys.executable, "finetune/main.py", "--config", "mistral7b_full", "--deepspeed", "zero3",
           f"model.path={SHAPE}", "model.tokenizer=mistral-common", f"data.path={DATA}", f"train.output_dir={out}",
           *overrides]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=loopback_env(), capture_output=True, text=True, timeout=120,
                          preexec_fn=_limit_address_space)
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-4000:]
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and proc.stderr == errors[0] + "\n", output[-4000:]
    assert errors[0].startswith("zerotune: error: full fine-tuning of mistral model ") and "without a GPU needs at " \
        "least 108 GiB of this host's memory" in errors[0]
    assert "Traceback" not in output
    assert elapsed < 10, f"{elapsed:.1f} s"
    assert _snapshot(str(out)) == before
