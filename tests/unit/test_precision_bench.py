"""benchmarks/precision.py's bookkeeping, without training: the bf16/fp8 comparison on synthetic losses (largest and
final relative difference after the warm-up, the step of the largest, PASS/FAIL at the gate, an fp8 run that did not
apply FP8), the table, and --table merging the results of several calls. `--smoke` runs the launches on a CPU."""

import json
import os
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import precision  # noqa: E402


def _run(kind, name, losses, eval_loss, applied="auto", tps=1000.0, peak=40.0):
    return {"kind": kind, "precision": name, "exit": 0, "wall_s": 100.0, "steps": list(range(1, len(losses) + 1)),
            "losses": losses, "eval_loss": eval_loss, "fp8_applied": name == "fp8" if applied == "auto" else applied,
            "tokens_per_s_per_gpu": tps, "peak_mem_gib": peak}


def test_largest_and_final_difference_after_the_warmup():
    bf16 = _run("lora", "bf16", [10.0, 4.0, 2.0, 2.0, 2.0], 2.0, tps=1000.0, peak=40.0)
    fp8 = _run("lora", "fp8", [20.0, 4.0, 2.01, 1.995, 2.002], 2.004, tps=1250.0, peak=30.0)
    c = precision.compare(bf16, fp8, warmup_skip=1)  # step 1's 100% difference is the warm-up's
    assert c["largest"] == pytest.approx(0.005) and c["largest_step"] == 3
    assert c["final"] == pytest.approx(0.001) and c["eval"] == pytest.approx(0.002)
    assert [s for s, _ in c["step_diffs"]] == [2, 3, 4, 5]
    assert c["speed_ratio"] == 1.25 and c["peak_mem_gib"] == {"bf16": 40.0, "fp8": 30.0}
    assert c["verdict"] == "PASS" and c["reasons"] == []
    assert precision.compare(bf16, fp8, warmup_skip=0)["verdict"] == "FAIL"


def test_the_gate_of_each_kind():
    base = [2.0] * 30
    within = [2.0] * 29 + [2.0 * 1.0099]  # 0.99%: under LoRA's 1%
    over = [2.0] * 29 + [2.0 * 1.0101]
    lora = precision.compare(_run("lora", "bf16", base, 2.0), _run("lora", "fp8", within, 2.0 * 1.0049), 20)
    assert lora["verdict"] == "PASS"
    lora = precision.compare(_run("lora", "bf16", base, 2.0), _run("lora", "fp8", over, 2.0), 20)
    assert lora["verdict"] == "FAIL" and lora["reasons"] == ["step difference 1.01% at step 30 > 1.0%"]
    lora = precision.compare(_run("lora", "bf16", base, 2.0), _run("lora", "fp8", within, 2.0 * 1.0051), 20)
    assert lora["reasons"] == ["eval difference 0.51% > 0.5%"]
    # full fine-tuning: 2% for the steps and for the eval
    full = precision.compare(_run("full", "bf16", base, 2.0), _run("full", "fp8", over, 2.0 * 1.019), 20)
    assert full["verdict"] == "PASS"
    full = precision.compare(_run("full", "bf16", base, 2.0), _run("full", "fp8", [2.0] * 29 + [2.05], 2.0), 20)
    assert full["verdict"] == "FAIL" and full["largest_step"] == 30


def test_an_fp8_run_without_fp8_never_passes():
    same = [2.0] * 30
    c = precision.compare(_run("lora", "bf16", same, 2.0), _run("lora", "fp8", same, 2.0, applied=False), 20)
    assert c["verdict"] == "FAIL" and c["reasons"] == ["fp8 was not applied (speedups.json)"]
    c = precision.compare(_run("lora", "bf16", same, 2.0), _run("lora", "fp8", same, 2.0, applied=None), 20)
    assert c["verdict"] == "FAIL"  # no speedups.json: not known to have run FP8
    failed = {**_run("lora", "fp8", same[:3], None), "exit": 1, "error": "Traceback"}
    c = precision.compare(_run("lora", "bf16", same, 2.0), failed, 20)
    assert c["verdict"] == "FAIL" and "fp8 run failed (exit 1)" in c["reasons"]


def test_the_table_has_a_row_per_run_and_the_verdict():
    runs = [_run("lora", "bf16", [2.0] * 30, 2.0, tps=1000.0),
            _run("lora", "fp8", [2.0] * 29 + [2.03], 2.0, tps=1300.0, peak=30.0),
            _run("full", "bf16", [3.0] * 30, 3.0)]
    text = precision.table(runs, precision.comparisons(runs, 20))
    assert "| lora | bf16 | 0 | 30 | 2.0000 | 2.0000 | 1,000 | 40.0 | no | 100 |" in text
    assert "| lora | fp8 | 0 | 30 | 2.0300 | 2.0000 | 1,300 | 30.0 | yes | 100 |" in text
    assert "| full | bf16 |" in text and "full, steps" not in text  # no fp8 run of full: nothing compared
    assert ("lora, steps after 20: largest step difference 1.50% at step 30 (gate 1.0%), final 1.50%, eval 0.00% "
            "(gate 0.5%), tok/s fp8/bf16 1.30x, peak 40.0 -> 30.0 GiB: FAIL (step difference 1.50% at step 30 > "
            "1.0%)") in text


def test_table_merges_the_calls(tmp_path, capsys, monkeypatch):
    plots = []  # matplotlib's import alone takes seconds: the smoke draws the plot
    monkeypatch.setattr(precision, "plot", lambda runs, compared, path: plots.append((len(runs), path)))
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    old_fp8 = _run("lora", "fp8", [2.0] * 30, 2.0, applied=False)
    a.write_text(json.dumps({"runs": [_run("lora", "bf16", [2.0] * 30, 2.0), old_fp8], "settings": {"steps": 30}}))
    b.write_text(json.dumps({"runs": [_run("lora", "fp8", [2.0] * 29 + [2.001], 2.0)], "settings": {"steps": 30}}))
    out = tmp_path / "merged" / "precision.json"
    assert precision.main(["--table", str(a), str(b), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "lora, steps after 20:" in printed and printed.rstrip().endswith(": PASS")  # b's fp8 run replaced a's
    merged = json.loads(out.read_text())
    assert sorted(r["precision"] for r in merged["runs"]) == ["bf16", "fp8"]
    assert merged["comparisons"][0]["verdict"] == "PASS" and merged["settings"]["merged"] == [str(a), str(b)]
    assert "date" in merged["environment"] and "torch" in merged["environment"]
    assert plots == [(2, str(tmp_path / "merged" / "precision.png"))]
