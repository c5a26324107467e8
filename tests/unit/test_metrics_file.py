"""metrics.jsonl has one reader (finetune.run.metrics.read_metrics): records in order, a bad line named by file and line;
a resumed run cuts the file back to its checkpoint; the training entry point still exports what callers import."""

import json

import pytest

from finetune.run.metrics import MetricsError, read_metrics, truncate_metrics
from finetune.step import StepResult, step_record


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))


def test_read_metrics_returns_records_in_order_and_skips_blank_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [json.dumps({"step": 1, "loss": 2.5}), "", json.dumps({"step": 1, "eval_loss": 2.4}), "  "])
    assert read_metrics(str(path)) == [{"step": 1, "loss": 2.5}, {"step": 1, "eval_loss": 2.4}]


def test_read_metrics_names_the_file_and_line_of_a_bad_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [json.dumps({"step": 1, "loss": 2.5}), '{"step": 2, "lo'])
    with pytest.raises(MetricsError, match=rf"^{path}:2: not a JSON line$"):
        read_metrics(str(path))


def test_truncate_keeps_the_steps_up_to_the_checkpoint_byte_for_byte(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": s, "loss": 10.0 / s, "mfu": None, "lr": 1e-4 * s} for s in range(1, 5)]
    records.insert(2, {"step": 2, "eval_loss": float("nan")})
    _write(path, [json.dumps(r) for r in records])
    original = path.read_text()
    truncate_metrics(str(path), keep_until=2)
    assert path.read_text() == "".join(original.splitlines(keepends=True)[:3])
    truncate_metrics(str(path), keep_until=0)  # a fresh run starts the file empty
    assert path.read_text() == ""
    truncate_metrics(str(tmp_path / "new.jsonl"), keep_until=3)  # nothing to keep yet
    assert (tmp_path / "new.jsonl").read_text() == ""


def test_step_record_has_the_keys_of_metrics_jsonl():
    result = StepResult(lr=1e-3, loss_sum=30.0, n_targets=10.0, tokens=40.0, flops=8e12, seconds=2.0, grad_norm=None,
                        peak_gib=1.5, reserved_gib=2.0)
    record = step_record(3, result, world=2, peak_tflops=None)
    assert list(record) == ["step", "loss", "lr", "grad_norm", "tokens", "target_tokens", "tokens_per_s",
                            "tokens_per_s_per_gpu", "mfu", "step_time_s", "peak_mem_gib", "peak_reserved_gib", "peak_host_gib"]
    assert record["loss"] == 3.0 and record["tokens_per_s_per_gpu"] == 10.0 and record["mfu"] is None
    assert step_record(3, result, world=2, peak_tflops=1.0)["mfu"] == pytest.approx(2.0)


def test_the_entry_point_still_exports_what_callers_import():
    from finetune import prepare, step, train

    assert train.prepare is prepare.prepare and train.Run is prepare.Run and train.parse_args is prepare.parse_args
    assert train.TrainingError is step.TrainingError and train.evaluate is step.evaluate
    assert callable(train.main) and callable(train.train)


@pytest.mark.parametrize("cuda,unit", [(True, "GPU"), (False, "rank")])
def test_the_progress_line_names_what_a_rank_ran_on(monkeypatch, capsys, tmp_path, cuda, unit):
    """Tokens/s per GPU under CUDA; on a CPU, per rank (a process), never labelled GPU."""
    import torch

    from finetune.run.metrics import MetricsLog

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    MetricsLog(str(tmp_path), 10, enabled=True).progress(
        {"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1150.0, "tokens_per_s_per_gpu": 575.0,
         "peak_mem_gib": 1.0})
    assert f"| 1,150 tok/s (575/{unit}) |" in capsys.readouterr().out
