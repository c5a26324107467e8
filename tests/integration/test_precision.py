"""model.precision=fp8 in real engines on CPU (gloo, loopback): LoRA with its FP8 base (kept under ZeRO-2, quantized at
each use under ZeRO-3) and full fine-tuning's FP8 projections, on 1 rank and on 2.

- ZeRO-2 and ZeRO-3 on 2 ranks give the losses of ZeRO-2 on 1 rank (fp32, 1e-5), LoRA and full;
- 3 steps, stop, resume to 6: steps 4-6 bit-identical to the straight run, under ZeRO-2 (whose checkpoint holds no
  frozen base weight: the FP8 copy is rebuilt from model.path) and ZeRO-3;
- a bf16 FP8 LoRA run's merged export (`zerotune export RUN --merge`) is the bf16 base + the adapters, bit for bit,
  not the FP8 copy.

The numerics of one forward and backward against a plain-PyTorch reference: tests/unit/test_precision.py."""

import json
import os

import pytest
import torch

from tests.fixtures.parity_cases import STEPS, overrides
from tests.helpers import ROOT, TINY_RECIPE, ds_variant, run_ranks, save_tiny_model, train_cases

HALF = STEPS // 2
CURVE_BOUND = 1e-3  # relative; measured up to 1.1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp8")
    model_dir = save_tiny_model(str(tmp / "model"))
    ds = {stage: ds_variant(f"zero{stage}", str(tmp / f"z{stage}.json"), bf16=False) for stage in (2, 3)}

    def case(name, stage, lora, world, *extra, kind="plain"):
        out = str(tmp / f"w{world}" / name)
        return {"name": name, "kind": kind, "config": TINY_RECIPE, "deepspeed": ds[stage],
                "overrides": overrides(model_dir, out, lora, world) + ["model.precision=fp8", *extra]}

    (tmp / "cases1").mkdir()
    one = train_cases(1, [case(f"{kind}-zero2", 2, kind == "lora", 1) for kind in ("lora", "full")], tmp / "cases1")
    two = []
    for kind in ("lora", "full"):
        for stage in (2, 3):
            n = f"{kind}-zero{stage}"
            two.append(case(n, stage, kind == "lora", 2, "train.export=false"))
            halves = ["train.export=false", f"train.save_every={HALF}"]
            two.append(case(f"{n}/stop", stage, kind == "lora", 2, *halves, f"train.stop_at={HALF}", kind="stop"))
            two[-1]["overrides"] += [f"train.output_dir={tmp / 'halves' / n}"]
            two.append(case(f"{n}/resume", stage, kind == "lora", 2, *halves, "train.resume=auto", kind="resume"))
            two[-1]["overrides"] += [f"train.output_dir={tmp / 'halves' / n}"]
    bf16_ds = ds_variant("zero2", str(tmp / "z2-bf16.json"), bf16=True)
    two.append({**case("lora-bf16", 2, True, 2), "deepspeed": bf16_ds})
    cases_file, out = tmp / "cases2.json", tmp / "out2.json"
    cases_file.write_text(json.dumps(two))
    run_ranks(2, os.path.join(ROOT, "tests", "drivers", "resume_driver.py"), [str(out), str(cases_file)], timeout=1200)
    return {"one": one, "two": json.loads(out.read_text()), "tmp": tmp, "model_dir": model_dir}


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_two_ranks_under_zero2_and_zero3_give_the_losses_of_one(runs, kind):
    """Step 1 (the same weights) within 1e-5: both world sizes run the same micro-batches (finetune/data/packing.py
    micro_batches), and a sum of two micro-batch gradients is the same in either order. After updates the runs'
    weights still differ by fp32 rounding, which an FP8 rounding can turn into a step of 2^-4 of one element: ZeRO-2's
    clipping norm (DeepSpeed rounds each rank's sum of squares to fp32 before the all-reduce), and ZeRO-3 against the
    ZeRO-2 reference (the stages round apart on one rank too). So the later steps stay within CURVE_BOUND, a tenth of
    the gap between FP8 and the unquantized model (tests/unit/test_precision.py), where without FP8 they are within
    1e-5 (tests/integration/test_parity.py)."""
    ref = runs["one"][f"{kind}-zero2"]["loss"]
    assert len(ref) == STEPS and ref[-1] < ref[0] - 0.05
    for stage in (2, 3):
        got = runs["two"][f"{kind}-zero{stage}"]
        assert abs(got[0] - ref[0]) < 1e-5, (stage, got, ref)
        assert max(abs(a - b) / b for a, b in zip(got, ref)) < CURVE_BOUND, (stage, got, ref)
    for world in ("w1", "w2"):  # the FP8 path ran: equal losses cannot come from two bf16 runs
        with open(runs["tmp"] / world / f"{kind}-zero2" / "speedups.json") as f:
            assert {s["name"]: s["on"] for s in json.load(f)}["fp8"] is True


@pytest.mark.parametrize("name", ["lora-zero2", "lora-zero3", "full-zero2", "full-zero3"])
def test_resume_continues_the_same_losses_bit_for_bit(runs, name):
    straight, stop, resume = (runs["two"][f"{name}{s}"] for s in ("", "/stop", "/resume"))
    assert stop == straight[:HALF] and resume == straight[HALF:], (straight, stop, resume)


def test_merged_export_is_the_bf16_base_plus_the_adapters(runs, tmp_path):
    from safetensors.torch import load_file

    from finetune.export.weights import export_final
    from finetune.perf import fp8

    run_dir = runs["tmp"] / "w2" / "lora-bf16"
    merged_dir = export_final(str(run_dir), str(tmp_path / "merged"), merge=True)
    merged = {k: v for f in os.listdir(merged_dir) if f.endswith(".safetensors")
              for k, v in load_file(os.path.join(merged_dir, f)).items()}
    base = load_file(os.path.join(runs["model_dir"], "model.safetensors"))
    adapter = load_file(os.path.join(run_dir, "export", "adapter_model.safetensors"))
    config = json.loads((run_dir / "export" / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    checked = 0
    for key in [k for k in adapter if k.endswith("lora_A.weight")]:
        name = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
        a, b = adapter[key].float(), adapter[key.replace("lora_A", "lora_B")].float()
        w = base[name]  # the saved base (fp32 here), merged in fp32 and written in the run's dtype
        expected = (w.float() + scaling * (b @ a)).to(torch.bfloat16)
        assert merged[name].dtype == torch.bfloat16 and torch.equal(merged[name], expected), name
        w_q, w_scale = fp8.quantize_weight(w.to(torch.bfloat16))  # what the run's GEMMs used
        from_fp8 = (w_q.float() * w_scale + scaling * (b @ a)).to(torch.bfloat16)
        assert not torch.equal(merged[name], from_fp8), name  # the FP8 copy's rounding would show
        checked += 1
    assert checked == 2 * 7
