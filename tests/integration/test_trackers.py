"""TensorBoard and W&B (offline) get exactly the records of metrics.jsonl from a real tiny run; neither package is
needed to train, and asking for a missing one is a clear error before training starts."""

import glob
import json
import struct
import numpy as np
from tests.helpers import TINY_RECIPE, loopback_env, run_ranks


def read_tensorboard(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0 = keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_wandb(run_file) -> tuple[dict, list[dict]]:
    """(config, history rows) of an offline .wandb file: W&B's 7-byte header, then LevelDB log records of protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(run_file, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    block, pos, pending, config, history = 32768, 7, b"", {}, []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment: a whole record
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.HasField("run"):
                config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.run.config.update})
            if record.HasField("history"):
                history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return config, history


def test_tiny_run_logs_the_same_records_to_tensorboard_and_wandb(tmp_path):
    out, wandb_dir = tmp_path / "run", tmp_path / "wandb"
    wandb_dir.mkdir()
    env = loopback_env(WANDB_MODE="offline", WANDB_DIR=str(wandb_dir), WANDB_SILENT="true")
    run_ranks(1, "finetune/main.py", ["--deepspeed", "ds_configs/zero2.json", "--config", TINY_RECIPE, "train.max_steps=4",
                                      "data.eval_fraction=0.1", "train.eval_every=2", "train.export=false",
                                      "train.sample_prompt=", "train.log_to=[tensorboard,wandb]", f"train.output_dir={out}"],
              timeout=600, env=env)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    assert [s for s, _ in steps] == [1, 2, 3, 4] and [s for s, _ in evals] == [2, 4]

    tb = read_tensorboard(out / "tensorboard")
    as_f32 = lambda pairs: [(s, float(np.float32(v))) for s, v in pairs]  # TensorBoard stores float32 scalars
    assert tb["train/loss"] == as_f32(steps)
    assert tb["eval/loss"] == as_f32(evals)
    assert tb["train/lr"] == as_f32([(r["step"], r["lr"]) for r in records if "lr" in r])
    assert "train/mfu" not in tb  # None on CPU: no point, rather than a fake 0

    runs = glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, runs
    config, history = read_wandb(runs[0])
    assert [(h["_step"], h["train/loss"]) for h in history if "train/loss" in h] == steps  # exact: W&B keeps float64
    assert [(h["_step"], h["eval/loss"]) for h in history if "eval/loss" in h] == evals
    assert config["recipe"]["train"]["log_to"] == ["tensorboard", "wandb"]
