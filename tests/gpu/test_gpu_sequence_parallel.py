"""Sequence parallelism on GPUs: NCCL's all-to-all and FlexAttention's block mask of the gathered rows, where the CPU
tests (tests/integration/test_sequence_parallel.py) run gloo and the dense reference mask. sequence_parallel=2 on 2
GPUs against 1 GPU, ZeRO-3 LoRA and ZeRO-2 full, fp32 and bf16. Needs 2 CUDA GPUs; CI (CPU) skips it. The lead's GPU
call (kind nvidia-h200-x2) runs it:

    .venv/bin/python -m pytest -q tests/gpu/test_gpu_sequence_parallel.py
"""

import json
import os

import pytest
import torch

from finetune.perf import attention
from tests.helpers import ROOT, TINY_RECIPE, ds_variant, run_ranks, save_tiny_model
from tests.fixtures.sequence_parallel_cases import overrides

pytestmark = pytest.mark.skipif(attention.available() is not None or torch.cuda.device_count() < 2,
                                reason=str(attention.available() or "needs 2 CUDA GPUs"))

CASES = [(3, True, False), (3, True, True), (2, False, False), (2, False, True)]  # (stage, lora, bf16)


def _name(stage: int, lora: bool, bf16: bool) -> str:
    return f"zero{stage}-{'lora' if lora else 'full'}-{'bf16' if bf16 else 'fp32'}"


def _gpu_env() -> dict:
    """The GPUs themselves, and the rendezvous on loopback (tests/helpers.loopback_env would hide them)."""
    return dict(os.environ, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=ROOT,
                TOKENIZERS_PARALLELISM="false")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-sp")
    model_dir = save_tiny_model(str(tmp / "model"))
    out = {}
    for world in (1, 2):
        cases = []
        for stage, lora, bf16 in CASES:
            ds = ds_variant(f"zero{stage}", str(tmp / f"zero{stage}-{bf16}.json"), bf16=bf16)
            cases.append({"name": _name(stage, lora, bf16), "config": TINY_RECIPE, "deepspeed": ds,
                          "overrides": overrides(model_dir, str(tmp / f"w{world}" / _name(stage, lora, bf16)), lora,
                                                 world, 1)})
        (tmp / f"cases{world}.json").write_text(json.dumps(cases))
        run_ranks(world, os.path.join(ROOT, "tests", "drivers", "sequence_parallel_driver.py"),
                  [str(tmp / f"out{world}.json"), str(tmp / f"cases{world}.json")], timeout=1200, env=_gpu_env())
        out[world] = json.loads((tmp / f"out{world}.json").read_text())
    return out


@pytest.mark.parametrize("stage,lora,bf16", CASES, ids=[_name(*c) for c in CASES])
def test_two_gpus_sharing_rows_equal_one(runs, stage, lora, bf16):
    one, two = runs[1][_name(stage, lora, bf16)], runs[2][_name(stage, lora, bf16)]
    print(_name(stage, lora, bf16), one["loss"], two["loss"])
    assert two["sequence_parallel"] == 2 and two["attention"] == "zerotune_ulysses"
    tolerance = 2e-2 if bf16 else 1e-4  # the GPU's reduction orders differ between the layouts
    for key in ("loss", "eval_loss"):
        assert two[key] == pytest.approx(one[key], abs=tolerance, rel=0), key
    assert two["tokens"] == one["tokens"]
