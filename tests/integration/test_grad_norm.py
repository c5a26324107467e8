"""ZeRO-1/2's gradient norm (what clipping divides by, and the logged grad_norm) is the same bit for bit on 1 rank and
on 2 with finetune/model/optim.py's install_exact_grad_norm, where DeepSpeed's own methods differ in the last bit for
some gradients: they round each rank's float64 sum of squares to float32 before the all-reduce. Both the norm of the
partitioned gradients and the norm under CPU offload; inf or NaN is still -1, which the step treats as an overflow.

In whole trainings: tests/integration/test_precision.py (full ZeRO-2 under FP8 on 2 ranks gives the losses of 1 rank
bit for bit) and tests/integration/test_parity.py."""

import json
import os

import pytest

from tests.helpers import ROOT, run_ranks

TRIALS = 64


@pytest.fixture(scope="module")
def norms(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grad_norm")
    cases = [{"name": "clean", "trials": TRIALS, "nan": False}, {"name": "nan", "trials": 4, "nan": True}]
    (tmp / "cases.json").write_text(json.dumps(cases))
    run_ranks(2, os.path.join(ROOT, "tests", "drivers", "grad_norm_driver.py"),
              [str(tmp / "out.json"), str(tmp / "cases.json")], timeout=300)
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("path", ["direct", "offload"])
def test_two_ranks_give_the_norm_of_one_bit_for_bit(norms, path):
    clean = norms["clean"]
    exact, deepspeed = clean[f"exact_{path}"], clean[f"deepspeed_{path}"]
    assert all(one == two for one, two in exact), exact
    # The gradients are ones where DeepSpeed's rounding shows, or the equality above proves little.
    assert sum(one != two for one, two in deepspeed) > 0, deepspeed
    # The norm itself: float64's, rounded once to float32 (half a float32 ulp: 2^-24 relative at most).
    assert [one for one, _ in exact] == pytest.approx(clean["float64"], rel=2**-24, abs=0)


@pytest.mark.parametrize("path", ["direct", "offload"])
def test_a_nan_gradient_still_gives_the_invalid_norm(norms, path):
    assert norms["nan"][f"exact_{path}"] == norms["nan"][f"deepspeed_{path}"] == [[-1.0, -1.0]] * 4
