"""model.recompute_segment in real engines on 2 ranks (CPU, gloo, loopback), with each segment's kept input on the
GPU (full) or in CPU memory (offload; under LoRA only the first segment's, model.offload_layers=1): two-level
recomputation gives the losses of plain `full` checkpointing, LoRA under ZeRO-3 (the rebuild's layer calls gather
each layer's weights through ZeRO-3's hooks, in backward) and full fine-tuning under ZeRO-2 with the row split over
the 2 ranks (sequence parallel 2: the rebuild's attention calls run the all-to-alls again, on both ranks alike), with
the tiled MLP.

One step of the tiny model against `full` in-process, bit for bit: tests/unit/test_two_level.py."""

import pytest

from tests.fixtures.parity_cases import STEPS, overrides
from tests.helpers import TINY_RECIPE, ds_variant, save_tiny_model, train_cases


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two_level")
    model_dir = save_tiny_model(str(tmp / "model"))
    cases = []
    for kind, stage, sp in (("lora", 3, 1), ("full", 2, 2)):
        ds = ds_variant(f"zero{stage}", str(tmp / f"z{stage}.json"), bf16=False)
        split = [f"train.sequence_parallel={sp}", "model.attn_implementation=flex"] if sp > 1 else []
        for segment, checkpointing in (("null", "full"), ("2", "full"), ("2", "offload")):
            name = f"{kind}-zero{stage}-segment{segment}" + ("-offload" if checkpointing == "offload" else "")
            # LoRA offloads the first of its 2 segments' inputs only (model.offload_layers), full fine-tuning both
            part = ["model.offload_layers=1"] if checkpointing == "offload" and kind == "lora" else []
            cases.append({"name": name, "config": TINY_RECIPE, "deepspeed": ds, "overrides": overrides(
                model_dir, str(tmp / name), kind == "lora", 2) + [
                    f"model.recompute_segment={segment}", f"model.activation_checkpointing={checkpointing}",
                    "model.tiled_mlp=on", "lora.dropout=0.1", *split, *part]})
    return train_cases(2, cases, tmp)


@pytest.mark.parametrize("offload", [False, True], ids=["gpu", "host"])
@pytest.mark.parametrize("name", ["lora-zero3", "full-zero2"])
def test_two_level_keeps_the_loss_curve_of_full_checkpointing(runs, name, offload):
    """Under offload each segment's kept input waits in CPU memory (on a CPU run, the same memory: the path is what
    is tested, the copy and the rebuild from it)."""
    plain, two_level = runs[f"{name}-segmentnull"], runs[f"{name}-segment2" + ("-offload" if offload else "")]
    assert plain["activation_checkpointing"] == "full"
    assert two_level["activation_checkpointing"] == ("offload" if offload else "full")
    assert plain["sequence_parallel"] == two_level["sequence_parallel"] == (2 if name == "full-zero2" else 1)
    assert len(plain["loss"]) == STEPS and plain["loss"][-1] < plain["loss"][0]
    assert max(abs(a - b) for a, b in zip(two_level["loss"], plain["loss"])) < 1e-6, (two_level, plain)
    assert max(abs(a - b) for a, b in zip(two_level["grad_norm"], plain["grad_norm"])) < 1e-6
