"""One run per output folder, and resume checks what changed, with real single-process training runs (CPU, gloo,
loopback): two runs started into one folder at the same moment (one trains, the other is refused naming it); a
train.resume=auto run started while the first is training, after its first checkpoint (refused; nothing of the
running job touched); then the finished run's checkpoint resumed with a parameter-altering change (refused, nothing
written) and with a safe one (allowed, listed). The lock and comparison logic alone: tests/unit/test_folder_lock.py,
tests/unit/test_resume_check.py."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from finetune import checkpoint
from finetune.run import folder_lock
from finetune.config import ConfigError
from tests.helpers import ROOT, SMALL_VOCAB, TINY_RECIPE, free_port, loopback_env, save_tiny_model

ZERO2 = os.path.join(ROOT, "ds_configs", "zero2.json")
STEPS, SAVE_EVERY = 16, 4


def _start(model: str, out, *overrides: str) -> subprocess.Popen:
    """`python -m finetune.cli train` in one process (RANK 0 of 1), output captured."""
    env = loopback_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, "-m", "finetune.cli", "train", "--config", TINY_RECIPE, "--deepspeed", ZERO2,
           f"model.path={model}", f"model.tokenizer={SMALL_VOCAB}", "data.max_seq_len=128", "train.sample_prompt=null",
           "train.export=false", "train.log_every=100", f"train.max_steps={STEPS}", f"train.save_every={SAVE_EVERY}",
           "train.keep_last=0", f"train.output_dir={out}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _snapshot(folder) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def raced(tmp_path_factory):
    """Two runs started together into one folder; the winner paused after its first checkpoint while a resume=auto
    run tries the folder, then let finish. Returns what was seen along the way."""
    tmp = tmp_path_factory.mktemp("run_folder")
    model = save_tiny_model(str(tmp / "model"))
    out = tmp / "run"
    lock_file = out / folder_lock.LOCK_FILE
    procs = [_start(model, out), _start(model, out)]
    locked_at = loser = None
    deadline = time.monotonic() + 300
    while loser is None:  # the first to exit is the refused one: the winner is still training
        assert time.monotonic() < deadline, "neither run ended"
        if locked_at is None and lock_file.exists():
            locked_at = time.monotonic()
        loser = next((p for p in procs if p.poll() is not None), None)
        time.sleep(0.01)
    refused_after = time.monotonic() - (locked_at or time.monotonic())
    winner = next(p for p in procs if p is not loser)
    first = out / "checkpoints" / f"step_{SAVE_EVERY:08d}"
    while not (first / "zerotune.json").exists():
        assert winner.poll() is None, winner.communicate()
        assert time.monotonic() < deadline, "no first checkpoint"
        time.sleep(0.005)
    os.kill(winner.pid, signal.SIGSTOP)  # training, between its first checkpoint and its last: paused, flock held
    try:
        paused = _snapshot(out)
        resumed = _start(model, out, "train.resume=auto")
        resumed_out, resumed_err = resumed.communicate(timeout=300)
        after_refusal = _snapshot(out)
    finally:
        os.kill(winner.pid, signal.SIGCONT)
    winner_out, winner_err = winner.communicate(timeout=300)
    return dict(tmp=tmp, out=out, model=model, winner=winner, winner_log=winner_out + winner_err, loser=loser,
                loser_err=loser.communicate()[1], refused_after=refused_after, paused=paused, resumed=resumed,
                resumed_err=resumed_err, after_refusal=after_refusal, first=first)


def test_two_runs_started_together_one_trains_the_other_is_refused_naming_it(raced):
    winner, loser = raced["winner"], raced["loser"]
    assert winner.returncode == 0, raced["winner_log"][-3000:]
    assert loser.returncode == 2
    assert loser.pid != winner.pid
    err = raced["loser_err"]
    errors = [line for line in err.splitlines() if line.startswith("zerotune: error:")]
    assert len(errors) == 1 and errors[0].startswith("zerotune: error: train.output_dir "), err
    assert f"is in use by another run (host {socket.gethostname()}, PID {winner.pid}, started " in err
    assert "Wait for it to end or stop it, or choose another train.output_dir" in err
    # Refused as soon as it reached the folder, with the winner holding it (both started at once, the same imports)
    assert raced["refused_after"] < 10


def test_resume_while_training_is_refused_and_touches_nothing(raced):
    assert raced["resumed"].returncode == 2
    assert f"PID {raced['winner'].pid}" in raced["resumed_err"] and "is in use by another run" in raced["resumed_err"]
    assert raced["after_refusal"] == raced["paused"]  # byte for byte, metrics.jsonl and recipe.yaml included


def test_the_running_job_ends_whole_and_gives_its_folder_back(raced):
    out = raced["out"]
    steps = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1))  # every step once, in order
    saved = [s for s, _ in checkpoint.complete_checkpoints(str(out))]
    assert saved == list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
    first = {k: v for k, v in raced["paused"].items() if k.startswith(os.path.relpath(raced["first"], out))}
    assert first and all(_snapshot(out)[k] == v for k, v in first.items())  # the first checkpoint as written
    assert not (out / folder_lock.LOCK_FILE).exists()  # released at the end of a normal run
    assert "took over" not in raced["winner_log"]


def _prepare(raced, *overrides: str):
    from finetune.train import prepare

    return prepare(TINY_RECIPE, ZERO2, [f"model.path={raced['model']}", f"model.tokenizer={SMALL_VOCAB}",
                                        "data.max_seq_len=128", f"train.max_steps={STEPS}",
                                        f"train.save_every={SAVE_EVERY}", "train.keep_last=0",
                                        f"train.output_dir={raced['out']}", "train.resume=auto", *overrides])


def test_resume_with_lora_flipped_is_refused_and_writes_nothing(raced):
    before = _snapshot(raced["out"])
    with pytest.raises(ConfigError) as e:
        _prepare(raced, "lora.enabled=true")
    rows = [line.split() for line in str(e.value).splitlines()]
    assert ["lora.enabled", "false", "true"] in rows and len(rows) == 4  # message, header, the one row, what to do
    assert _snapshot(raced["out"]) == before and not (raced["out"] / folder_lock.LOCK_FILE).exists()


def test_resume_with_another_layer_count_is_refused(raced):
    other = raced["tmp"] / "model-3-layers"
    other.mkdir()
    config = json.loads((raced["tmp"] / "model" / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    before = _snapshot(raced["out"])
    with pytest.raises(ConfigError, match=r"model num_hidden_layers \(config.json\) +2 +3"):
        _prepare(raced, f"model.path={other}")
    assert _snapshot(raced["out"]) == before


def test_resume_with_another_lr_is_allowed_and_the_change_listed(raced, capsys):
    try:
        run = _prepare(raced, "optim.lr=1e-3")
        assert run.resume_from.endswith(f"step_{STEPS:08d}")
    finally:
        folder_lock.release_all()
    printed = capsys.readouterr().out
    assert "with these settings changed (none alters the parameters)" in printed
    assert ["optim.lr", "0.005", "0.001"] in [line.split() for line in printed.splitlines()]
    assert "took over" not in printed
