"""model.precision=fp8 in real engines on CPU (gloo, loopback): LoRA with its FP8 base (kept under ZeRO-2, quantized at
each use under ZeRO-3) and full fine-tuning's FP8 projections, on 1 rank and on 2.

- ZeRO-2 and ZeRO-3 on 2 ranks give the losses of the same stage on 1 rank (with twice the accumulation) bit for bit
  at every step, LoRA and full;
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
    one = train_cases(1, [case(f"{kind}-zero{stage}", stage, kind == "lora", 1, "train.export=false")
                          for kind in ("lora", "full") for stage in (2, 3)], tmp / "cases1")
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


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_two_ranks_under_zero2_and_zero3_give_the_losses_of_one(runs, kind, stage):
    """Every step bit for bit, FP8's rounding of the weights included, because nothing in a step depends on the
    number of ranks: both world sizes run the same micro-batches (finetune/data/packing.py micro_batches), a sum of
    two micro-batch gradients is the same in either order, and ZeRO-2's clipping norm is summed across ranks in
    float64 (finetune/model/optim.py install_exact_grad_norm; DeepSpeed's rounds each rank's part to float32 first,
    a last-bit difference that FP8's rounding of the weights grows into full ZeRO-2's losses from step 3). The
    stages are compared each with itself: ZeRO-2 and ZeRO-3 compute the norm apart, and under FP8 their losses
    differ on 1 rank too."""
    name = f"{kind}-zero{stage}"
    one, two = runs["one"][name]["loss"], runs["two"][name]
    assert len(one) == STEPS and one[-1] < one[0] - 0.05  # it learns, or equality proves little
    assert two == one, [(a - b) / b for a, b in zip(two, one)]
    for world in ("w1", "w2"):  # the FP8 path ran: equal losses cannot come from two bf16 runs
        with open(runs["tmp"] / world / name / "speedups.json") as f:
            on = {s["name"]: s["on"] for s in json.load(f)}
        # LoRA under ZeRO-3 gathers whole layers (finetune/perf/layer_gather.py) under FP8 too
        assert on["fp8"] is True and on["layer_gather"] is (kind == "lora" and stage == 3)


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
