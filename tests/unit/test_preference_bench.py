"""benchmarks/preference.py's bookkeeping, without GPUs: the synthetic pairs (lengths in real Mistral tokens, two pairs
to a 4,096-token row), TRL's settings tried in order until one runs, and the table. What the launches run is
measured on an H200 (docs/benchmarks/2026-12-03-h200-preference.md); `--smoke` runs them all on a CPU."""

import json
import os
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import preference  # noqa: E402


def test_pairs_have_the_asked_lengths_and_two_fill_a_row(tmp_path):
    path = str(tmp_path / "pairs.jsonl")
    stats = preference.write_pairs(path, 16, 496, 504)
    records = [json.loads(line) for line in open(path)]
    assert len(records) == 16 and all(set(r) == {"prompt", "chosen", "rejected"} for r in records)
    assert all(r["chosen"] != r["rejected"] for r in records)
    # BOS, [INST] ... [/INST] and EOS around 496 + 473..504 tokens
    assert 960 <= stats["sequence_tokens_min"] <= stats["sequence_tokens_max"] <= 1024
    assert 2 * stats["pair_tokens_max"] <= 4096
    again = str(tmp_path / "again.jsonl")
    assert preference.write_pairs(again, 16, 496, 504) == stats and open(again).read() == open(path).read()


@pytest.fixture
def peer_args(tmp_path):
    class A:
        pass

    a = A()
    a.peer_settings = ((8, "off", "on"), (4, "off", "on"), (8, "on", "on"))
    a.model, a.tokenizer_dir, a.data, a.env = "m", "t", "d.jsonl", {}
    a.steps, a.skip, a.run_timeout, a.min_run_s, a.workdir = 12, 3, 240, 90, str(tmp_path)
    return a


def _launches(monkeypatch, outcomes):
    """launch() replaced: each call takes the next outcome, "oom" or a pairs/s it writes as the peer's JSON."""
    calls = []

    def launch(script, gpus, log, timeout, env=None):
        calls.append((script, timeout))
        outcome = outcomes[len(calls) - 1]
        if outcome == "oom":
            return 1, "torch.OutOfMemoryError: CUDA out of memory", 30.0
        out = script[script.index("--out") + 1]
        batch = int(script[script.index("--batch") + 1])
        json.dump({"pairs_per_s": outcome, "tokens_per_s": outcome * 2000, "step_time_s": batch / outcome,
                   "pairs_per_step": batch, "peak_mem_gib": 100.0, "losses": [0.69], "tokens_per_pair": 2000,
                   "padded_tokens_per_pair": 2010, "step_times": [1.0]}, open(out, "w"))
        return 0, "", 60.0

    monkeypatch.setattr(preference, "launch", launch)
    return calls


def test_trl_falls_back_to_the_next_settings_after_running_out_of_memory(monkeypatch, peer_args):
    calls = _launches(monkeypatch, ["oom", 5.0])
    tries = preference.run_peer(peer_args, deadline=preference.time.monotonic() + 500)
    assert [c[0][c[0].index("--batch") + 1] for c in calls] == ["8", "4"]
    assert tries[0]["error"] == "out of memory" and "pairs_per_s" not in tries[0]
    assert tries[1]["pairs_per_s"] == 5.0 and tries[1]["settings"].startswith("ckpt off, liger on, 4 pairs")


def test_no_further_try_without_the_time_for_one(monkeypatch, peer_args):
    calls = _launches(monkeypatch, ["oom", 5.0])
    tries = preference.run_peer(peer_args, deadline=preference.time.monotonic() + 60)
    assert len(calls) == 1 and calls[0][1] <= 60 and tries[0]["error"] == "out of memory"


def test_table_shows_the_last_try_and_the_ratio_to_trl():
    runs = [{"config": "lora_zero2", "system": "zerotune", "pairs_per_s": 9.0, "tokens_per_s": 18000.0,
             "peak_mem_gib": 110.0, "settings": "ckpt none"},
            {"config": "lora_zero2", "system": "trl", "error": "out of memory", "exit": 1, "settings": "b8"},
            {"config": "lora_zero2", "system": "trl", "pairs_per_s": 5.0, "tokens_per_s": 10000.0,
             "peak_mem_gib": 70.0, "settings": "b4"},
            {"config": "full_zero3", "system": "zerotune", "error": "out of memory", "exit": 1, "settings": "x"}]
    text = preference.table(runs)
    assert "| lora_zero2 | zerotune | ckpt none | 9.00 | 18,000 | 110.0 | 1.80 |" in text
    assert "| lora_zero2 | trl | b4 | 5.00 | 10,000 | 70.0 |  |" in text and "| b8 |" not in text
    assert "| full_zero3 | zerotune | x | failed (out of memory) |" in text
    assert "1.80x pairs/s (target 1.5x: met)" in text
    runs[2]["pairs_per_s"] = 7.0
    assert "(target 1.5x: not met)" in preference.table(runs)


def test_a_launch_past_its_time_limit_ends_with_its_ranks(tmp_path, monkeypatch):
    """The launcher's children go too: a rank left running would hold the GPU while the next launch starts."""
    pidfile = tmp_path / "rank.pid"
    fake = tmp_path / "bin" / "deepspeed"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\nwait\n")
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    code, _, wall = preference.launch(["x.py"], 1, str(tmp_path / "log"), 2, env)
    assert code == 124 and wall < 30
    status = f"/proc/{int(pidfile.read_text())}/status"

    def alive() -> bool:
        try:
            return "\nState:\tZ" not in open(status).read()
        except FileNotFoundError:
            return False

    deadline = preference.time.monotonic() + 10  # SIGKILL reaches it at once; its exit takes a moment
    while alive() and preference.time.monotonic() < deadline:
        preference.time.sleep(0.05)
    assert not alive()
