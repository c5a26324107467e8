"""`zerotune compare` end to end: the tiny recipe under ZeRO-0 and ZeRO-3 (the two ends; every stage's losses are
tests/integration/test_parity.py's) through launch/compare.sh (real `deepspeed` launches,
2 processes, loopback), then the summary, the loss check and the plots read back; plus the flagging logic on made-up runs.

The command runs where matplotlib cannot be imported (tests/fixtures/no_matplotlib first on PYTHONPATH): it must still
exit 0 with its summary and a note about the plots. The plots are then drawn from the same runs by the code compare
runs after training (`summarize`), with matplotlib."""

import json
import os
import subprocess
import pytest
from PIL import Image
from finetune.commands.compare import summarize
from tests.helpers import ROOT, SMALL_VOCAB, TINY_RECIPE, loopback_env


STAGES = ["zero0", "zero3"]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "cmp"
    cmd = ["bash", os.path.join(ROOT, "launch", "compare.sh"), "--config", TINY_RECIPE, "--stages", "0", "3",
           "--steps", "3", "--gpus", "2", "--out", str(out), "data.max_seq_len=128",
           # the tiny model with the small vocabulary: config.json and tokenizer, no weights (a random init)
           f"model.path={SMALL_VOCAB}", f"model.tokenizer={SMALL_VOCAB}"]
    env = loopback_env()
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "tests", "fixtures", "no_matplotlib"), env["PYTHONPATH"]])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    without = {"stderr": proc.stderr, "summary": json.load(open(out / "summary.json")),
               "summary_md": (out / "summary.md").read_text(), "pngs": sorted(p.name for p in out.glob("*.png"))}
    summary = dict(without["summary"])
    summarize(str(out), summary.pop("runs"), summary)  # what compare does after training, now with matplotlib
    return out, json.load(open(out / "summary.json")), without


def test_without_matplotlib_compare_exits_0_with_its_summary_and_a_note(compared):
    out, _, without = compared
    assert "plots skipped: matplotlib is not installed" in without["stderr"]
    assert "pip install 'zerotune[plot]'" in without["stderr"]
    assert [r["name"] for r in without["summary"]["runs"]] == STAGES and without["summary"]["plots"] == {}
    assert "Plots: not drawn, matplotlib is not installed" in without["summary_md"]
    assert f"zerotune plot {out / 'zero0'}" in without["summary_md"]  # how to draw them later
    assert without["pngs"] == []


def test_every_stage_ran_from_one_init_and_losses_agree(compared):
    """bf16 stages hold the init rounded to bf16, ZeRO-0 (autocast) in fp32: the first losses agree to bf16 rounding."""
    out, summary, _ = compared
    runs = {r["name"]: r for r in summary["runs"]}
    assert list(runs) == STAGES
    assert summary["tolerance"] == 2e-2  # ds_configs are bf16
    # tiny has no weights: every stage draws the same random init itself (finetune/model/init_weights.py), none is saved
    assert "init_model" not in summary and not (out / "init_model").exists()
    for name, run in runs.items():
        steps = [json.loads(line) for line in open(out / name / "metrics.jsonl")]
        assert [r["loss"] for r in steps] == run["losses"] and run["steps"] == [1, 2, 3], name
        assert run["timed_steps"] == [2, 3]  # the first step is warm-up, left out of throughput
        expected = sum(r["tokens"] for r in steps[1:]) / sum(r["step_time_s"] for r in steps[1:]) / 2
        assert run["tokens_per_s_per_gpu"] == pytest.approx(expected)
        assert run["max_loss_diff"] <= 2e-2 and not run["flagged"], (name, run["losses"], runs["zero0"]["losses"])
        assert run["estimated_gib"] > 0 and run["peak_mem_gib"] > 0
    # Same weights at step 1: every stage's first loss agrees far below the tolerance (bf16 rounding only).
    assert max(abs(r["losses"][0] - runs["zero0"]["losses"][0]) for r in runs.values()) < 2e-3


def test_summary_md_lists_every_stage(compared):
    out, _, _ = compared
    text = (out / "summary.md").read_text()
    for name in STAGES:
        assert f"| {name} | {name[-1]} | no |" in text
    assert "LOSS DIFFERS" not in text and "the first 1 left out as warm-up" in text


def test_plots_are_drawn_from_these_runs(compared):
    out, summary, _ = compared
    run_dirs = [str(out / name) for name in STAGES]
    for png in ("throughput_memory.png", "loss_curves.png"):
        assert (out / png).stat().st_size > 10_000, png
        assert summary["plots"][png]["runs"] == run_dirs
        with Image.open(out / png) as image:
            source = json.loads(image.text["Source"])  # the PNG itself names its run folders
            assert image.size[0] >= 600
        if png == "loss_curves.png":  # zerotune plot's figure: also how many points of each series it drew
            assert [d["points"]["loss"] for d in source] == [3] * len(STAGES)
            source = [d["run_dir"] for d in source]
        assert source == run_dirs

