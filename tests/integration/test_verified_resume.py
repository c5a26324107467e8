"""Verified checkpoints with real engines on 2 ranks (CPU, gloo, loopback): a straight run of 6 steps saves every 2
steps, each checkpoint with a manifest.json that both ranks' read-back filled; one optimizer shard of the newest
checkpoint is then truncated. `zerotune export` refuses it naming the file, and train.resume=auto warns naming the
file, resumes from the checkpoint before it and continues that run's loss curve bit for bit, deleting nothing and
saving a good step 6 in place of the damaged one. The manifest alone: tests/unit/test_manifest.py."""

from __future__ import annotations

import json
import os

import pytest

from finetune import checkpoint
from tests.helpers import ROOT, SMALL_VOCAB, TINY_RECIPE, ds_variant, run_ranks, save_tiny_model

MAIN = os.path.join(ROOT, "finetune", "main.py")
STEPS, SAVE_EVERY = 6, 2
SHARD = "engine/zero_pp_rank_1_mp_rank_00_optim_states.pt"  # rank 1's part of the ZeRO-2 optimizer state


def _losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in open(run / "metrics.jsonl") if '"loss"' in line]


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """The straight run, its checkpoints' manifests as saved, then its step-6 checkpoint with one shard cut in half."""
    tmp = tmp_path_factory.mktemp("verified")
    model = save_tiny_model(str(tmp / "model"))
    run = tmp / "run"
    args = ["--deepspeed", ds_variant("zero2", str(tmp / "zero2.json"), bf16=False), "--config", TINY_RECIPE,
            f"model.path={model}", f"model.tokenizer={SMALL_VOCAB}", "lora.enabled=false", "data.max_seq_len=128",
            "optim.lr=1e-3", "optim.warmup_steps=3", f"train.max_steps={STEPS}", "train.micro_batch_size=1",
            "train.grad_accum=2", "train.sample_prompt=null", "train.log_every=100", f"train.save_every={SAVE_EVERY}",
            "train.keep_last=0", "train.export=false", f"train.output_dir={run}"]
    run_ranks(2, MAIN, args, timeout=600)
    saved = {step: json.loads(open(path / checkpoint.MANIFEST).read())
             for step, path in ((s, run / "checkpoints" / f"step_{s:08d}") for s in (2, 4, 6))}
    straight = _losses(run)
    newest = run / "checkpoints" / "step_00000006"
    size = os.path.getsize(newest / SHARD)
    os.truncate(newest / SHARD, size // 2)
    return {"tmp": tmp, "run": run, "args": args, "saved": saved, "straight": straight, "newest": newest, "size": size}


def test_every_saved_file_is_in_the_manifest_and_verifies(damaged):
    run, saved = damaged["run"], damaged["saved"]
    for step, written in saved.items():
        path = str(run / "checkpoints" / f"step_{step:08d}")
        assert written["algorithm"] == "sha256"
        # Both ranks' files (rank 1's shard and RNG state too), the marker, DeepSpeed's own files: nothing left out.
        assert {"zerotune.json", "rng_rank0.pt", "rng_rank1.pt", SHARD} <= set(written["files"])
        on_disk = {os.path.relpath(os.path.join(d, f), path) for d, _, files in os.walk(path) for f in files}
        assert set(written["files"]) == on_disk - {checkpoint.MANIFEST}
        if step != 6:
            assert checkpoint.verify(path) == []


def test_export_refuses_the_truncated_checkpoint(damaged, capsys):
    from finetune.export.weights import main as export_main

    newest, size = damaged["newest"], damaged["size"]
    out = damaged["tmp"] / "exported"
    assert export_main([str(damaged["run"]), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{SHARD}: truncated ({size // 2:,} of {size:,} bytes)" in err
    assert err.startswith(f"zerotune: error: {str(newest)!r} does not match its manifest.json"), err
    assert "export another checkpoint with --step N (other complete checkpoints: 2, 4)" in err
    assert not out.exists()


def test_resume_auto_skips_the_truncated_checkpoint_and_continues_the_one_before(damaged):
    # Runs after the export test: it must see the damaged shard, which this resume replaces with a good step 6.
    run, newest, size = damaged["run"], damaged["newest"], damaged["size"]
    done = run_ranks(2, MAIN, damaged["args"] + ["train.resume=auto"], timeout=600)
    warning = (f"zerotune: warning: skipping checkpoint {newest}: it does not match its manifest.json: {SHARD}: "
               f"truncated ({size // 2:,} of {size:,} bytes); checking the one before")
    assert done.stderr.count(warning) == 1, done.stderr[-3000:]  # rank 0 says it, once
    before = run / "checkpoints" / "step_00000004"
    assert f"resumed from {before} at step 4" in done.stdout
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert _losses(run) == damaged["straight"], "steps 5-6 must be the straight run's, bit for bit"
    # Nothing was deleted; step 6 was saved again, whole, in place of the damaged one.
    assert [s for s, _ in checkpoint.complete_checkpoints(str(run))] == [2, 4, 6]
    assert checkpoint.verify(str(newest)) == []
    resaved = json.loads(open(newest / checkpoint.MANIFEST).read())["files"]
    assert resaved[SHARD] == damaged["saved"][6]["files"][SHARD], "the re-saved shard is the straight run's"
