"""Resuming on another layout, without an engine: which route a checkpoint takes (DeepSpeed's own, portable/, the
universal conversion, or a refusal that says why), the data position when the rows per step change, and the disk
estimate. The engine tests (moments equal after loading, losses equal the straight run's) are
tests/integration/test_checkpoint.py."""

import json

import numpy as np
import pytest

from finetune import checkpoint
from finetune.config import ConfigError
from finetune.data.loader import IGNORE, StepLoader, TokenizedData, step_position


def saved(tmp_path, world: int, stage: int, portable: bool):
    path = tmp_path / f"w{world}-z{stage}-{portable}" / "step_00000006"
    path.mkdir(parents=True, exist_ok=True)
    marker = {"step": 6, "world_size": world, "ds_config": {"zero_optimization": {"stage": stage}}}
    (path / checkpoint.MARKER).write_text(json.dumps(marker))
    if portable:
        (path / "portable").mkdir(exist_ok=True)
        (path / "portable" / "index.json").write_text("{}")
    return str(path)


def ds(stage: int, nvme: bool = False) -> dict:
    return {"zero_optimization": {"stage": stage, **({"offload_optimizer": {"device": "nvme"}} if nvme else {})}}


def test_the_route_of_a_checkpoint(tmp_path):  # this process is 1 rank
    assert checkpoint.resume_route(saved(tmp_path, 1, 3, False), ds(3)) == ("engine", "")
    assert checkpoint.resume_route(saved(tmp_path, 2, 3, True), ds(3)) == ("portable", "2 rank(s) -> 1")
    assert checkpoint.resume_route(saved(tmp_path, 1, 2, True), ds(3)) == ("portable", "ZeRO-2 -> ZeRO-3")
    assert checkpoint.resume_route(saved(tmp_path, 2, 2, False), ds(2)) == ("universal", "2 rank(s) -> 1")
    with pytest.raises(ConfigError, match="saved by 2 rank.s. under ZeRO-3 and it has no portable layout"):
        checkpoint.resume_route(saved(tmp_path, 2, 3, False), ds(3))
    with pytest.raises(ConfigError, match="saved under ZeRO-2 and it has no portable layout .* resumes only under "
                                          "ZeRO-2"):
        checkpoint.resume_route(saved(tmp_path, 1, 2, False), ds(3))
    with pytest.raises(ConfigError, match="cannot be loaded into an optimizer offloaded to NVMe"):
        checkpoint.resume_route(saved(tmp_path, 2, 3, True), ds(3, nvme=True))


def rows_data(n: int) -> TokenizedData:
    """n one-row samples (no packing): sample i starts with token 1000 + i."""
    return TokenizedData.from_samples([([1000 + i, 5, 5], [IGNORE, 5, 5]) for i in range(n)])


def samples(loader: StepLoader, steps) -> list[int]:
    return [i for step in steps for micro in loader.step(step) for i in micro["sample_ids"].tolist()]


def test_other_rows_per_step_continue_at_the_saved_row():
    """27 rows per epoch; a run of 6 rows per step saves after step 6 (epoch 0 in steps 0-4, the last one short;
    epoch 1 from step 5), a run of 4 rows per step continues it: every sample once per epoch, none skipped."""
    data = rows_data(27)
    six = StepLoader(data, 1, 6, 1, 0, capacity=64, packing=False, seed=3, pad_id=0)
    position = {"step": 0, "epoch": 0, "row": 0, "rows_per_step": 6}
    four = StepLoader(data, 1, 4, 1, 0, capacity=64, packing=False, seed=3, pad_id=0)
    four.start = four.continuing_at(6, position)
    assert four.start == (6, 1, 6) and four.position(6) == (1, 6)
    assert sorted(samples(six, range(5))) == list(range(27))
    epoch1 = samples(six, [5]) + samples(four, range(6, 12))  # 6 rows, then 21 rows in 6 steps (the last short)
    assert sorted(epoch1) == list(range(27))
    assert four.position(12) == (2, 0)
    # A third run, of 2 rows per step, resumed from the second's checkpoint of step 9.
    again = four.continuing_at(9, {"step": 6, "epoch": 1, "row": 6, "rows_per_step": 4})
    assert again == (9, 1, 18)


def test_the_default_start_is_the_step_number():
    for step in range(40):
        assert step_position(step, (0, 0, 0), 6, 27) == (step // 5, step % 5 * 6)
    order = np.random.default_rng(0)  # any start: the step after the start's epoch ends opens the next epoch at 0
    for _ in range(20):
        rows = int(order.integers(0, 27))
        assert step_position(3 + -(-(27 - rows) // 4), (3, 2, rows), 4, 27) == (3, 0)


def test_the_disk_estimate_counts_the_portable_state():
    cfg = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
    full = checkpoint.estimate_checkpoint_bytes(cfg, None)
    assert checkpoint.estimate_checkpoint_bytes(cfg, None, portable=True) - full == 12 * (full // 14)
