"""optim.overflow_check (finetune/perf/overflow_check.py): bf16 ZeRO-1/2 steps with a NaN gradient are skipped exactly as
under DeepSpeed's own two tests, clean steps are the same, and DeepSpeed's per-tensor test is not run."""

import json
import os

import pytest

from tests.helpers import ROOT, run_ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overflow")
    cases = [{"name": f"z{stage}-{check}-{'nan' if nan else 'clean'}", "stage": stage, "check": check, "nan": nan}
             for stage in (1, 2) for check in ("norm", "deepspeed", "off") for nan in (True, False)]
    (tmp / "cases.json").write_text(json.dumps(cases))
    run_ranks(1, os.path.join(ROOT, "tests", "drivers", "overflow_driver.py"), [str(tmp / "out.json"), str(tmp / "cases.json")],
              timeout=900)
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("stage", [1, 2])
def test_a_nan_gradient_skips_the_step_as_deepspeeds_own_check_does(results, stage):
    norm, ds = results[f"z{stage}-norm-nan"], results[f"z{stage}-deepspeed-nan"]
    assert norm["installed"] and not ds["installed"]
    assert norm["per_tensor_tests"] == 0 and ds["per_tensor_tests"] == 1
    for r in (norm, ds):
        assert r["loss"] == pytest.approx(results[f"z{stage}-norm-clean"]["loss"])  # a finite loss: only the gradient
        assert r["skipped"] == 1 and r["changed"] == 0 and r["nan_weights"] == 0
        assert r["grad_norm"] == float("inf")


@pytest.mark.parametrize("stage", [1, 2])
def test_without_any_check_the_nan_reaches_the_weights(results, stage):
    """Why zerotune does not simply turn bf16.check_grad_overflow off: DeepSpeed then applies the NaN step."""
    off = results[f"z{stage}-off-nan"]
    assert off["skipped"] == 0 and off["nan_weights"] > 0


@pytest.mark.parametrize("stage", [1, 2])
def test_clean_steps_are_identical_either_way(results, stage):
    norm, ds = results[f"z{stage}-norm-clean"], results[f"z{stage}-deepspeed-clean"]
    assert norm["skipped"] == ds["skipped"] == 0 and norm["changed"] > 0
    assert norm["weights"] == ds["weights"] and norm["grad_norm"] == ds["grad_norm"]
