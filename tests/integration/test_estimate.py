"""The memory estimator against the ZeRO paper's formulas (Mistral-7B's shape and the tiny model, LoRA and full), against
the bytes real DeepSpeed engines hold on each of 2 ranks, and its activation count against torch's saved tensors."""

import json
import os
import pytest
from finetune.memory.estimate import (estimate_model_states, precision_bytes)
from tests.helpers import ROOT, TINY_CONFIG, ds_variant, run_ranks, save_tiny_model
from tests.fixtures.estimate_cases import CASES, LORA
from tests.fixtures.model_shapes import TINY


# Padding: ZeRO-1/2 pad each flat group to a multiple of 2 x world elements, ZeRO-3 each tensor to a multiple of world.
# The tiny model's sizes are even, so the match is exact; 0.1% allows for the odd alignment element elsewhere.
REL = 1e-3



@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    model_dir = save_tiny_model(str(tmp / "model"), config_dir=os.path.dirname(TINY_CONFIG))  # TINY's shape
    cases = []
    for base, bf16, lora in CASES:
        name = f"{base}-{'bf16' if bf16 else 'fp32'}-{'lora' if lora else 'full'}"
        # every tensor partitioned under ZeRO-3, norms too (the default threshold would keep them whole)
        path = ds_variant(base, str(tmp / f"{name}.json"), bf16=bf16,
                          **({"stage3_param_persistence_threshold": 0} if base == "zero3" else {}))
        cases.append({"name": name, "deepspeed": path, "lora": lora, "stage": int(base[-1]), "bf16": bf16})
    (tmp / "cases.json").write_text(json.dumps(cases))
    run_ranks(2, os.path.join(ROOT, "tests", "drivers", "estimate_probe.py"), [model_dir, str(tmp / "cases.json"), str(tmp / "out")],
              timeout=1800)
    return cases, [json.load(open(tmp / f"out.{rank}.json")) for rank in (0, 1)]


@pytest.mark.parametrize("index", range(len(CASES)))
def test_estimate_matches_measured_bytes_per_rank(measured, index):
    cases, ranks = measured
    case = cases[index]
    ds = json.load(open(case["deepspeed"]))
    weight_bytes, _, adapter_bytes = precision_bytes(ds, case["stage"])
    est = estimate_model_states(TINY, LORA if case["lora"] else None, case["stage"], 2, dtype_bytes=weight_bytes,
                                adapter_dtype_bytes=adapter_bytes)
    for rank, results in enumerate(ranks):
        got = results[case["name"]]
        assert got["adam_tensors"] > 0, (case["name"], got)  # Adam's states exist: one step was taken
        assert got["params"] == pytest.approx(est["params"], rel=REL), (case["name"], rank, got, est)
        assert got["master"] + got["adam"] == pytest.approx(est["optimizer"], rel=REL), (case["name"], rank, got, est)
        assert got["adam"] == pytest.approx(8 * est["trained_parameters"] / (2 if case["stage"] else 1), rel=REL)
