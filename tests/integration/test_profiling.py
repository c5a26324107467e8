"""train.profile_step: one step's time by kind of kernel (finetune/perf/profiling.py), through a real training run on CPU,
and the categories kernel names fall into (those of the H200 profiles in docs/benchmarks/vs_peer/)."""

import json
from tests.helpers import SMALL_VOCAB, TINY_RECIPE, ds_variant, save_tiny_model, train_cases


def test_profile_step_writes_time_by_kernel_kind(tmp_path):
    """train.profile_step=N: the step's time split by kind of op (CPU here: aten ops), with matmuls among them."""
    model_dir = save_tiny_model(str(tmp_path / "model"))
    ds = ds_variant("zero2", str(tmp_path / "z2.json"), bf16=False)
    out = tmp_path / "run"
    cases = [{"name": "p", "config": TINY_RECIPE, "deepspeed": ds, "overrides": [
        f"model.path={model_dir}", f"model.tokenizer={SMALL_VOCAB}", "lora.enabled=false", "data.max_seq_len=128",
        "train.max_steps=3", "train.profile_step=2", "train.micro_batch_size=2", f"train.output_dir={out}",
        "train.sample_prompt=null"]}]
    train_cases(1, cases, tmp_path)
    report = json.loads((out / "profile_step2.json").read_text())
    assert report["step"] == 2 and report["device"] == "cpu" and report["wall_s"] > 0
    assert report["categories_s"]["matmul"] > 0 and 0 < report["busy_s"]
    assert any(r["name"] == "aten::mm" or r["name"] == "aten::addmm" for r in report["top"])
    assert "profile of step 2" in (out / "profile_step2.txt").read_text()
    # the train loop's host phases, each with the host time it took
    assert set(report["host_phases_s"]) == {"forward", "backward", "nonfinite check", "optimizer step"}
    assert report["host_phases_s"]["backward"] > 0 and report["idle_by_phase_s"] == {}  # no device timeline on CPU
    assert not (out / "profile_step1.json").exists() and not (out / "profile_step3.json").exists()
