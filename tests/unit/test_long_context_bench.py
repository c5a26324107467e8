"""benchmarks/long_context.py's bookkeeping, without GPUs: the ladder each system climbs until its first failure,
how --resume continues it, the zerotune command (no length-specific setting; rope_scaling past the model's range) and
the table. The launches are replaced by recorders: what they run is measured on an H200
(docs/benchmarks/2026-12-02-h200-long-context.md)."""

import json
import os
import sys

import pytest

from tests.helpers import ROOT, TINY_CONFIG

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import long_context  # noqa: E402

TINY_MODEL = os.path.dirname(TINY_CONFIG)  # max_position_embeddings 4096


@pytest.fixture
def recorded(monkeypatch):
    """Runs recorded; zerotune fits up to 32,768 tokens, the peer up to 16,384."""
    calls = []

    def fake(system, limit):
        def run(kind, length, a):
            calls.append((system, kind, length))
            if length > limit:
                return {"system": system, "kind": kind, "length": length, "exit": 1, "wall_s": 1.0,
                        "error": "out of memory"}
            return {"system": system, "kind": kind, "length": length, "exit": 0, "wall_s": 1.0,
                    "tokens_per_s_per_gpu": 1e8 / length, "step_time_s": length / 1e4, "peak_mem_gib": length / 1e3}
        return run

    monkeypatch.setattr(long_context, "run_zerotune", fake("zerotune", 32768))
    monkeypatch.setattr(long_context, "run_peer", fake("peer", 16384))
    return calls


def test_each_system_climbs_the_ladder_until_its_first_failure(recorded, tmp_path, capsys):
    assert long_context.main(["--out", str(tmp_path), "--max-length", "131072"]) == 0
    assert recorded == [("zerotune", "lora", n) for n in (8192, 16384, 32768, 65536)] + \
        [("peer", "lora", n) for n in (8192, 16384, 32768)]
    printed = capsys.readouterr().out
    assert "longest lora row zerotune trained: 32,768 tokens" in printed
    assert "longest lora row peer trained: 16,384 tokens" in printed
    assert "| zerotune | lora | 16,384 | 6,104 | 1.64 | 16.4 | 1.00 | |" in printed
    assert "| peer | lora | 32,768 | failed | | | | out of memory |" in printed


def test_resume_runs_only_what_is_missing_and_stops_at_a_recorded_failure(recorded, tmp_path):
    runs = [{"system": "zerotune", "kind": "lora", "length": 8192, "exit": 0, "wall_s": 1.0,
             "tokens_per_s_per_gpu": 1.0, "step_time_s": 1.0, "peak_mem_gib": 1.0},
            {"system": "peer", "kind": "lora", "length": 8192, "exit": 1, "wall_s": 1.0, "error": "time limit (300 s)"}]
    (tmp_path / "long_context.json").write_text(json.dumps({"runs": runs}))
    long_context.main(["--out", str(tmp_path), "--max-length", "32768", "--resume"])
    assert recorded == [("zerotune", "lora", 16384), ("zerotune", "lora", 32768)]
    saved = json.loads((tmp_path / "long_context.json").read_text())["runs"]
    assert [(r["system"], r["length"]) for r in saved] == [("zerotune", 8192), ("peer", 8192), ("zerotune", 16384),
                                                          ("zerotune", 32768)]


def test_zerotune_gets_the_recipe_auto_and_the_work_only(monkeypatch, tmp_path):
    launched = []

    def fake_launch(script, gpus, log, timeout, env=None):
        launched.append(script)
        return 1, "boom", 1.0

    monkeypatch.setattr(long_context, "launch", fake_launch)
    monkeypatch.setattr(long_context, "write_documents", lambda path, length, count: path)
    a = long_context.main.__globals__["argparse"].Namespace(model=TINY_MODEL, tokenizer="mistral-common",
                                                           out=str(tmp_path), steps=3, run_timeout=60, set=[],
                                                           deepspeed="auto")
    long_context.run_zerotune("lora", 4096, a)
    long_context.run_zerotune("lora", 16384, a)
    within, beyond = launched
    assert within[:5] == ["finetune/main.py", "--deepspeed", "auto", "--config", "recipes/mistral7b_lora.yaml"]
    assert not any(s.startswith(("model.rope_scaling", "model.attn", "model.tiled", "model.activation",
                                 "train.sequence_parallel")) for s in within)
    assert "data.max_seq_len=4096" in within and "train.micro_batch_size=1" in within
    assert beyond[-1] == ("model.rope_scaling={rope_type: yarn, factor: 4, original_max_position_embeddings: 4096}")


def test_the_alst_peer_runs_deepspeeds_parts_on_the_same_row_and_shares_the_table(monkeypatch, tmp_path):
    launched = []

    def fake_launch(script, gpus, log, timeout, env=None):
        launched.append((script, gpus))
        out = script[script.index("--out") + 1]
        with open(out, "w") as f:
            json.dump({"tokens_per_s_per_gpu": 4000.0, "step_time_s": 32.77, "peak_mem_gib": 70.5,
                       "peak_host_gib": 40.0, "losses": [10.4, 10.3, 10.2]}, f)
        return 0, "", 100.0

    monkeypatch.setattr(long_context, "launch", fake_launch)
    a = long_context.main.__globals__["argparse"].Namespace(model="/tmp/init", out=str(tmp_path), steps=3, skip=1,
                                                           run_timeout=60)
    r = long_context.run_alst("lora", 131072, a)
    (script, gpus), = launched
    assert gpus == 1 and script[0] == "benchmarks/peer_alst.py" and "--lora" in script
    assert script[script.index("--seq") + 1] == "131072" and script[script.index("--steps") + 1] == "3"
    assert r["tokens_per_s_per_gpu"] == 4000.0 and r["peak_host_gib"] == 40.0
    assert "| alst | lora | 131,072 | 4,000 | 32.77 | 70.5 |  | |" in long_context.table([r])


def test_a_failure_says_why():
    assert long_context._why(124, "", 300) == "time limit (300 s)"
    assert long_context._why(1, "torch.OutOfMemoryError: CUDA out of memory.", 300).startswith("out of memory")
