"""benchmarks/vs_peer.py's bookkeeping, without GPUs: which runs one command makes, how --resume continues a run
that --stop-after cut short, and how A/B variants reach the zerotune launch (recipe overrides, DeepSpeed edits,
environment). The launches themselves are replaced by recorders: what they run is measured on the H200s
(docs/benchmarks/2026-11-30-2xh200-vs-peer.md)."""

import argparse
import json
import os
import sys

import pytest

from tests.helpers import ROOT, TINY_CONFIG

TINY_MODEL = os.path.dirname(TINY_CONFIG)

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import vs_peer  # noqa: E402


@pytest.fixture
def recorded(monkeypatch):
    calls = []

    def fake_zerotune(config, a, variant=None):
        name = "zerotune" if not variant else f"zerotune:{variant[0]}"
        calls.append((name, config))
        return {"system": name, "config": config, "exit": 0, "wall_s": 1.0, "tokens_per_s_per_gpu": 1000.0,
                "peak_mem_gib": 1.0}

    def fake_peer(system, config, a):
        calls.append((system, config))
        return {"system": system, "config": config, "exit": 0, "wall_s": 1.0, "tokens_per_s_per_gpu": 500.0,
                "peak_mem_gib": 1.0}

    monkeypatch.setattr(vs_peer, "run_zerotune", fake_zerotune)
    monkeypatch.setattr(vs_peer, "run_peer", fake_peer)
    return calls


def test_one_command_runs_every_system_once_per_config(tmp_path, recorded):
    assert vs_peer.main(["--out", str(tmp_path)]) == 0
    # LoRA ZeRO-3's best settings are the peer's defaults: measured once
    assert len(recorded) == 11 and len(set(recorded)) == 11 and ("peer_best", "lora_zero3") not in recorded
    saved = json.loads((tmp_path / "vs_peer.json").read_text())
    assert len(saved["runs"]) == 11 and set(saved["versions"]) >= {"torch", "deepspeed", "transformers", "gpu"}


def test_stop_after_then_resume_completes_the_same_table(tmp_path, recorded, monkeypatch):
    clock = iter(range(0, 10_000, 100))  # each look at the clock is 100 s later
    monkeypatch.setattr(vs_peer.time, "monotonic", lambda: next(clock))
    assert vs_peer.main(["--out", str(tmp_path), "--stop-after", "250"]) == 3
    first = list(recorded)
    assert 0 < len(first) < 11
    failed = {"system": "peer_default", "config": "lora_zero3", "exit": 1, "error": "boom"}
    saved = json.loads((tmp_path / "vs_peer.json").read_text())
    saved["runs"].append(failed)  # a failed run is not kept: --resume runs it again
    (tmp_path / "vs_peer.json").write_text(json.dumps(saved))
    recorded.clear()
    monkeypatch.setattr(vs_peer.time, "monotonic", lambda: 0.0)
    assert vs_peer.main(["--out", str(tmp_path), "--resume"]) == 0
    assert set(first).isdisjoint(recorded) and len(first) + len(recorded) == 11
    runs = json.loads((tmp_path / "vs_peer.json").read_text())["runs"]
    assert sorted((r["system"], r["config"]) for r in runs) == sorted(first + recorded)
    assert all("error" not in r for r in runs)


def test_variant_edits_reach_the_launch(tmp_path, monkeypatch):
    launched = {}

    def fake_launch(script, gpus, log, timeout, env=None):
        launched.update(script=script, env=env)
        return 1, "stopped here", 0.5

    monkeypatch.setattr(vs_peer, "launch", fake_launch)
    a = argparse.Namespace(out=str(tmp_path), model="m", tokenizer="t", data="d", seq=128, steps=3, skip=1, gpus=2,
                           timeout=10, set=["model.precision=fp8"])
    result = vs_peer.run_zerotune("full_zero3", a, ["try", "model.recompute_layers=8",
                                                   "ds.zero_optimization.reduce_bucket_size=200000000",
                                                   "env.NCCL_MAX_NCHANNELS=4"])
    assert result["system"] == "zerotune:try" and result["exit"] == 1 and result["error"] == "stopped here"
    # --set's overrides first, the variant's after them (they win where both set a key)
    assert launched["script"][-2:] == ["model.precision=fp8", "model.recompute_layers=8"]
    assert launched["env"] == {"NCCL_MAX_NCHANNELS": "4"}
    edited = json.load(open(launched["script"][launched["script"].index("--deepspeed") + 1]))
    assert edited["zero_optimization"]["reduce_bucket_size"] == 200000000
    assert edited["zero_optimization"]["stage"] == 3  # the rest of ds_configs/zero3.json is kept


def test_settings_name_the_recomputed_layers_of_the_model(tmp_path):
    import yaml

    run = tmp_path / "zerotune_full_zero3"
    run.mkdir()
    (run / "recipe.yaml").write_text(yaml.safe_dump({
        "model": {"activation_checkpointing": "selective", "recompute_layers": 4, "path": TINY_MODEL},
        "train": {"micro_batch_size": 8, "grad_accum": 1}}))
    def applied(liger: bool, fp8: bool) -> None:  # speedups.json as a run writes it
        (run / "speedups.json").write_text(json.dumps([{"name": "liger", "switch": "model.kernels", "on": liger},
                                                       {"name": "fp8", "switch": "model.precision", "on": fp8}]))

    applied(liger=True, fp8=False)
    assert vs_peer._settings(str(run)) == "ckpt selective 4/4, liger on, mbs 8x1, bf16"  # the tiny model: 4 layers
    applied(liger=False, fp8=True)
    assert vs_peer._settings(str(run)).endswith("liger off, mbs 8x1, fp8")


def test_peer_steps_are_timed_end_to_end_like_zerotunes():
    """The peer's step time runs from the end of the step before (its data fetch and target count, done before
    on_step_begin, are inside), and run_peer keeps the begin-to-end figure beside it."""
    import peer_hf_trainer

    clock = peer_hf_trainer.StepClock()
    for begin, end in [(0.0, 2.0), (2.5, 4.0), (4.25, 5.5)]:  # 0.5 s and 0.25 s between the steps
        clock.begin(begin)
        clock.end(end)
    assert clock.times == [2.0, 2.0, 1.5]
    assert clock.callback_times == [2.0, 1.5, 1.25]


def test_run_peer_reports_both_timings(tmp_path, monkeypatch):
    def fake_launch(script, gpus, log, timeout, env=None):
        out = script[script.index("--out") + 1]
        json.dump({"step_times": [3.0, 2.0, 2.0], "step_times_callback": [3.0, 1.6, 1.6], "step_time_s": 2.0,
                   "tokens_per_s_per_gpu": 8 * 2048 / 2.0, "peak_mem_gib": 50.0}, open(out, "w"))
        return 0, "", 1.0

    monkeypatch.setattr(vs_peer, "launch", fake_launch)
    a = argparse.Namespace(out=str(tmp_path), model="m", seq=2048, steps=3, skip=1, gpus=2, timeout=10)
    r = vs_peer.run_peer("peer_best", "full_zero2", a)
    assert r["tokens_per_s_per_gpu"] == 8 * 2048 / 2.0
    assert r["tokens_per_s_per_gpu_callback"] == pytest.approx(8 * 2048 / 1.6)


def test_a_failed_row_says_whether_it_ran_out_of_memory():
    """A peer setting tuned on two GPUs can ask one for more than it has: the row says so, from the log's tail."""
    oom = {"system": "peer_best", "config": "full_zero3", "exit": 1, "settings": "ckpt off",
           "error": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 224.00 MiB."}
    crash = {**oom, "config": "lora_zero3", "error": "RuntimeError: NCCL error"}
    rows = vs_peer.table([oom, crash]).splitlines()
    assert any(line.startswith("| full_zero3 | peer_best | ckpt off | out of memory (exit 1) |") for line in rows)
    assert any(line.startswith("| lora_zero3 | peer_best | ckpt off | failed (exit 1) |") for line in rows)


def test_targets_given_on_the_command_line_replace_the_defaults_in_the_table(tmp_path, capsys):
    """gpu_fp8_vs_peer.sh shows its own targets: --target CONFIG=TOK_S, in the zerotune row's target column."""
    run = {"system": "zerotune", "config": "lora_zero2", "exit": 0, "tokens_per_s_per_gpu": 21000.0,
           "peak_mem_gib": 70.0, "settings": "ckpt none"}
    (tmp_path / "vs_peer.json").write_text(json.dumps({"runs": [run]}))
    assert vs_peer.main(["--table", str(tmp_path / "vs_peer.json"), "--target", "lora_zero2=22000"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| lora_zero2 | zerotune"))
    assert row.endswith("| 22,000 |"), row
    assert vs_peer.table([run]).splitlines()[-1].endswith(f"| {vs_peer.TARGETS['lora_zero2']:,} |")
    with pytest.raises(SystemExit):
        vs_peer.main(["--table", str(tmp_path / "vs_peer.json"), "--target", "lora_zero4=1"])


def test_the_plot_draws_the_given_targets_and_the_runs_gpu_count(tmp_path, monkeypatch):
    """The bars' red ticks are the table's targets (--target replaces TARGETS' there too); the title names the
    GPU count the runs had."""
    axes = pytest.importorskip("matplotlib.axes")
    drawn = {}
    scatter, set_title = axes.Axes.scatter, axes.Axes.set_title
    monkeypatch.setattr(axes.Axes, "scatter", lambda ax, x, y, *a, **k: drawn.update(ticks=list(y)) or scatter(ax, x, y, *a, **k))
    monkeypatch.setattr(axes.Axes, "set_title", lambda ax, text, *a, **k: drawn.update(title=text) or set_title(ax, text, *a, **k))
    run = {"system": "zerotune", "config": "lora_zero2", "exit": 0, "tokens_per_s_per_gpu": 21000.0,
           "peak_mem_gib": 70.0, "settings": "ckpt none"}
    (tmp_path / "vs_peer.json").write_text(json.dumps({"runs": [run], "gpus": 1, "seq": 2048}))
    png = tmp_path / "bars.png"
    assert vs_peer.main(["--table", str(tmp_path / "vs_peer.json"), "--plot", str(png), "--target",
                         "lora_zero2=22000"]) == 0
    assert png.stat().st_size > 0
    assert drawn["ticks"] == [22000 if c == "lora_zero2" else vs_peer.TARGETS[c] for c in vs_peer.CONFIGS]
    assert "1 GPU(s)" in drawn["title"]
