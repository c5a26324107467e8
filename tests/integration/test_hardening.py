"""The fault table: bad inputs and faults, each with the exact user-facing message and proof that nothing already
written was lost. docs/troubleshooting.md lists every row (tests/unit/test_hardening.py checks it).

Each in-process row runs the real code path (recipe, DeepSpeed JSON, model folder, tokenizer, data pipeline,
hostfile, output-dir checks) against a run folder that already holds a checkpoint, metrics and an export, and then
checks that folder byte for byte. Rows whose fault needs running ranks (a NaN loss here; kill -9, a lost rank, an
unreachable host and a busy port in their own test files) name the test that proves them."""

from __future__ import annotations
import json
import os
import re
import pytest
from tests.helpers import ROOT, TINY_RECIPE, run_ranks
from tests.fixtures.fault_table import FAULTS


ZERO0 = os.path.join(ROOT, "ds_configs", "zero0.json")


def test_nan_loss_stops_with_samples_and_a_checkpoint(tmp_path):
    """optim.lr=1e30 blows the weights up at step 1: every loss of step 2 is non-finite. The run stops at step 2
    with a message naming the samples, after saving the state at the start of step 2, which is exactly the state a
    clean 1-step run saves: the check (once per step, read after the last backward is queued) comes before the
    optimizer step, also when the first of the 2 accumulated micro-batches already went through backward."""
    import torch

    out, clean = tmp_path / "run", tmp_path / "clean"
    # ZeRO-0: DeepSpeed's ZeRO-2 optimizer skips a step whose gradient norm is NaN by itself (so the same test there
    # passes with the check moved after the step); its ZeRO-0 path (torch AdamW, zerotune's own clipping) does not.
    args = ["--deepspeed", ZERO0, "--config", TINY_RECIPE, "optim.lr=1e30", "optim.warmup_steps=0",
            "train.grad_accum=2", "train.sample_prompt=null", "train.export=false"]
    with pytest.raises(AssertionError) as e:
        run_ranks(2, "finetune/main.py", args + ["train.max_steps=5", f"train.output_dir={out}"], timeout=600)
    assert re.search(next(f.message for f in FAULTS if f.id == "nan-loss"), str(e.value))
    assert re.search(r"rank \d: \[\d+", str(e.value))
    assert (out / "checkpoints" / "step_00000001" / "zerotune.json").exists()
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1]

    run_ranks(2, "finetune/main.py", args + ["train.max_steps=1", "train.save_every=1", f"train.output_dir={clean}"],
              timeout=600)

    def weights(run_dir):
        path = run_dir / "checkpoints" / "step_00000001" / "engine" / "mp_rank_00_model_states.pt"
        return torch.load(path, map_location="cpu", weights_only=False)["module"]

    stopped, reference = weights(out), weights(clean)
    assert stopped.keys() == reference.keys()
    assert not any(v.isnan().any() for v in stopped.values())  # a step on NaN gradients would leave NaN weights
    assert all(torch.equal(stopped[k], reference[k]) for k in reference)
