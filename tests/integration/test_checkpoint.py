"""Exact resume and verified export, on 2 ranks with real engines (CPU, gloo, loopback).

- 6 steps straight vs 3 steps, stop, resume to 6: steps 4-6 bit-identical (ZeRO-2/3, LoRA/full, fp32/bf16).
- Saved at step 6 on 2 ranks, resumed on 1 and on 3; saved on 1, resumed on 2 (ZeRO-2/3, LoRA/full, fp32): the
  loaded fp32 weights and Adam moments equal the saved ones exactly, the losses the straight run's within 1e-6.
- The export of a ZeRO-3 run (HF folder for full, adapter and merged model for LoRA, in-training and offline
  `zerotune export`) reproduces the engine's logits on a fixed prompt.
- A half-written checkpoint is never resumed from; an unwritable output dir fails before the first step."""

import json
import os
import shutil

import pytest
import torch
from finetune import checkpoint
from finetune.config import ConfigError
from tests.helpers import (ROOT, SMALL_VOCAB, TINY_RECIPE, ds_variant, kill_two_ranks_when, run_ranks, save_tiny_model)


CASES = [(stage, lora, bf16) for stage in (2, 3) for lora in (False, True) for bf16 in (False, True)]
STEPS, HALF = 6, 3  # the straight runs' steps; the interrupted runs stop (and save) after HALF, then resume

# Another world size or ZeRO stage, through the checkpoint's portable/ state: fp32, lora.dropout=0 (a dropout mask
# is drawn per rank, so no mask matches across world sizes), micro-batch 1 and 6 rows per step on every world size
# (1 rank x accumulation 6, 2 x 3, 3 x 2), so that every straight run trains on the same rows.
PORTABLE = [(stage, lora) for stage in (2, 3) for lora in (False, True)]
RESHARDS = [(2, 1), (2, 3), (1, 2)]  # (saved on, resumed on)
P_STEPS, P_SAVED, ROWS = 9, 6, 6
LOSS_BOUND = 1e-6  # vs the straight run on the resumed world size (float sums differ in order across world sizes)


def name(stage, lora, bf16):
    return f"zero{stage}-{'lora' if lora else 'full'}-{'bf16' if bf16 else 'fp32'}"


def pname(stage, lora):
    return f"zero{stage}-{'lora' if lora else 'full'}"


def saved_at(tmp, n, world):
    return str(tmp / "portable" / n / f"w{world}" / "checkpoints" / f"step_{P_SAVED:08d}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every training of this file, in 4 launches: 1 rank, 2 ranks, 1 rank, 3 ranks (a resume after its save)."""
    tmp = tmp_path_factory.mktemp("resume")
    model_dir = save_tiny_model(str(tmp / "model"))
    launches = {0: [], 1: [], 2: [], 3: []}
    for stage, lora, bf16 in CASES:
        ds = ds_variant(f"zero{stage}", str(tmp / f"z{stage}-{bf16}.json"), bf16=bf16)
        common = [f"model.path={model_dir}", f"model.tokenizer={SMALL_VOCAB}", f"lora.enabled={str(lora).lower()}",
                  "lora.dropout=0.1", "lora.rank=8", "data.max_seq_len=128", "optim.lr=1e-3", "optim.warmup_steps=3",
                  f"train.max_steps={STEPS}", "train.micro_batch_size=1", "train.grad_accum=2", "train.sample_prompt=null",
                  "train.log_every=100"]
        n = name(stage, lora, bf16)
        straight, halves = str(tmp / n / "straight"), str(tmp / n / "halves")
        # Only the ZeRO-3 straight runs' exports are read (the export tests below); the other runs skip theirs.
        export = f"train.export={str(stage == 3).lower()}"
        launches[1] += [
            {"name": f"{n}/straight", "kind": "straight", "deepspeed": ds,
             "overrides": common + [f"train.output_dir={straight}", export]},
            {"name": f"{n}/stop", "kind": "stop", "deepspeed": ds,
             "overrides": common + [f"train.output_dir={halves}", f"train.save_every={HALF}", f"train.stop_at={HALF}"]},
            {"name": f"{n}/resume", "kind": "resume", "deepspeed": ds,
             "overrides": common + [f"train.output_dir={halves}", f"train.save_every={HALF}", "train.resume=auto",
                                    "train.export=false"]},
        ]

    def portable_case(case, stage, lora, world, out, *extra):
        ds = ds_variant(f"zero{stage}", str(tmp / f"z{stage}-False.json"), bf16=False)
        overrides = [f"model.path={model_dir}", f"model.tokenizer={SMALL_VOCAB}", f"lora.enabled={str(lora).lower()}",
                     "lora.dropout=0", "lora.rank=8", "data.max_seq_len=128", "optim.lr=1e-3", "optim.warmup_steps=3",
                     f"train.max_steps={P_STEPS}", "train.micro_batch_size=1", f"train.grad_accum={ROWS // world}",
                     "train.sample_prompt=null", "train.log_every=100", "train.export=false",
                     f"train.save_every={P_SAVED}", f"train.output_dir={tmp / 'portable' / out}", *extra]
        return {**case, "deepspeed": ds, "overrides": overrides}

    for stage, lora in PORTABLE:
        n = pname(stage, lora)
        # The straight runs save at step P_SAVED on their way: the checkpoints the resumes start from.
        for world, launch in ((1, 0), (2, 1), (3, 3)):
            launches[launch].append(portable_case({"name": f"{n}/w{world}", "kind": "resume"}, stage, lora, world,
                                                  f"{n}/w{world}"))
        for saved, world in RESHARDS:
            launch = {1: 2, 2: 1, 3: 3}[world]
            launches[launch].append(portable_case({"name": f"{n}/{saved}to{world}", "kind": "reshard"}, stage, lora,
                                                  world, f"{n}/{saved}to{world}", f"train.resume={saved_at(tmp, n, saved)}"))
    # ZeRO-2 -> ZeRO-3 on the same 2 ranks; ZeRO-2 saved on 2 ranks resumed on 1 with 4 rows per step (the data then
    # continues at the saved run's row); an older checkpoint (no portable/) on another world size: DeepSpeed's
    # universal conversion, as before.
    launches[1].append(portable_case({"name": "zero2to3", "kind": "reshard"}, 3, False, 2, "zero2to3",
                                     f"train.resume={saved_at(tmp, pname(2, False), 2)}"))
    launches[1].append(portable_case({"name": "legacy/w2", "kind": "stop"}, 2, False, 2, "legacy/w2",
                                     "train.portable_checkpoints=false", f"train.stop_at={P_SAVED}"))
    launches[2].append(portable_case({"name": "legacy/2to1", "kind": "resume"}, 2, False, 1, "legacy/2to1",
                                     f"train.resume={tmp / 'portable' / 'legacy' / 'w2'}"))
    launches[2].append(portable_case({"name": "rows/2to1", "kind": "resume"}, 2, False, 1, "rows/2to1",
                                     "train.grad_accum=4", f"train.max_steps={P_SAVED + 2}", "train.save_every=2",
                                     f"train.resume={saved_at(tmp, pname(2, False), 2)}"))
    results, stdout = {}, {}
    driver = os.path.join(ROOT, "tests", "drivers", "resume_driver.py")
    for launch, world in enumerate([1, 2, 1, 3]):
        (tmp / f"cases{launch}.json").write_text(json.dumps(launches[launch]))
        done = run_ranks(world, driver, [str(tmp / f"out{launch}.json"), str(tmp / f"cases{launch}.json")],
                         timeout=2400)
        stdout[launch] = done.stdout
        results.update(json.loads((tmp / f"out{launch}.json").read_text()))
    return tmp, results, stdout


@pytest.mark.parametrize("stage, lora, bf16", CASES, ids=[name(*c) for c in CASES])
def test_resume_continues_the_same_loss_curve(runs, stage, lora, bf16):
    tmp, losses, _ = runs
    n = name(stage, lora, bf16)
    straight, first, second = losses[f"{n}/straight"], losses[f"{n}/stop"], losses[f"{n}/resume"]
    assert len(straight) == STEPS and len(first) == HALF and len(second) == STEPS - HALF
    assert first == straight[:HALF]
    assert second == straight[HALF:], "the resumed steps must be bit-identical to the uninterrupted run's"
    metrics = [json.loads(line) for line in open(tmp / n / "halves" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    kept = [s for s, _ in checkpoint.complete_checkpoints(str(tmp / n / "halves"))]
    assert kept == [HALF, STEPS]


@pytest.mark.parametrize("saved, world", RESHARDS, ids=[f"{a}to{b}" for a, b in RESHARDS])
@pytest.mark.parametrize("stage, lora", PORTABLE, ids=[pname(*c) for c in PORTABLE])
def test_resume_on_another_world_size(runs, stage, lora, saved, world):
    """Saved at step 6 on `saved` ranks, resumed on `world`: right after loading, every trained parameter's fp32
    master, weight and Adam moments equal the saved ones exactly, and so do the optimizer's steps and DeepSpeed's
    counters; the continued losses equal the straight run's on `world` ranks within LOSS_BOUND."""
    tmp, results, _ = runs
    n = pname(stage, lora)
    got, straight = results[f"{n}/{saved}to{world}"], results[f"{n}/w{world}"]
    assert got["checked"] > 0 and got["differ"] == []
    assert got["steps"] == [P_SAVED] * len(got["steps"])
    assert (got["global_steps"], got["global_samples"], got["schedule_step"]) == (P_SAVED, P_SAVED * ROWS, P_SAVED)
    assert len(got["losses"]) == P_STEPS - P_SAVED
    assert got["losses"] == pytest.approx(straight[P_SAVED:], abs=LOSS_BOUND, rel=0)
    kept = [s for s, _ in checkpoint.complete_checkpoints(str(tmp / "portable" / n / f"{saved}to{world}"))]
    assert kept == [P_STEPS]


def test_resume_under_another_zero_stage(runs):
    """A ZeRO-2 checkpoint continues under ZeRO-3 on the same ranks, from its portable state."""
    _, results, stdout = runs
    got = results["zero2to3"]
    assert got["differ"] == [] and got["steps"] == [P_SAVED] * len(got["steps"])
    assert got["losses"] == pytest.approx(results[f"{pname(3, False)}/w2"][P_SAVED:], abs=LOSS_BOUND, rel=0)
    assert "on another layout (ZeRO-2 -> ZeRO-3): trained weights, Adam moments and steps from its portable/ state" \
        in stdout[1]


def test_a_checkpoint_without_portable_state_reshards_through_deepspeeds_universal_one(runs):
    """train.portable_checkpoints=false (or a checkpoint of an older zerotune): ZeRO-1/2 still resume on another
    world size, through DeepSpeed's universal conversion, within 1e-4 of the straight run."""
    tmp, results, stdout = runs
    assert not os.path.exists(os.path.join(checkpoint.find_latest(str(tmp / "portable" / "legacy" / "w2")), "portable"))
    assert "(2 rank(s) -> 1), through DeepSpeed's universal checkpoint" in stdout[2]
    assert results["legacy/2to1"] == pytest.approx(results[f"{pname(2, False)}/w1"][P_SAVED:], abs=1e-4, rel=0)


def test_other_rows_per_step_continue_at_the_saved_row(runs):
    """Saved after 6 steps of 6 rows, resumed with 4 rows per step: the data continues at row 6 of epoch 1 (an epoch
    is 27 rows here: 5 steps of 6, the last one short), where step 6 of a 4-row order would start at row 24 of epoch
    0; the checkpoints it saves keep that position for the next resume."""
    tmp, _, stdout = runs
    assert ("the saved run took 6 rows per step, this one takes 4: the data continues at row 6 of epoch 1, where "
            "the saved run stopped") in stdout[2]
    with open(os.path.join(checkpoint.find_latest(str(tmp / "portable" / "rows" / "2to1")), checkpoint.MARKER)) as f:
        assert json.load(f)["data_position"] == {"step": P_SAVED, "epoch": 1, "row": 6, "rows_per_step": 4}


def test_zero3_checkpoint_without_portable_state_on_another_world_size_is_refused(runs, tmp_path):
    from finetune.train import prepare

    tmp, _, _ = runs
    old = tmp_path / "run" / "checkpoints" / f"step_{P_SAVED:08d}"  # saved by 2 ranks; this process is 1 rank
    shutil.copytree(saved_at(tmp, pname(3, False), 2), old, ignore=shutil.ignore_patterns("portable"))
    with pytest.raises(ConfigError, match="saved by 2 rank.s. under ZeRO-3 and it has no portable layout .portable/: "
                                          "saved with train.portable_checkpoints=false, or by an older zerotune.; "
                                          "resume it on that many ranks"):
        prepare(TINY_RECIPE, str(tmp / "z3-False.json"), [f"model.path={tmp / 'model'}", "train.resume=auto",
                                                          f"train.output_dir={tmp_path / 'run'}"])


def _prompt():
    from tests.drivers.resume_driver import PROMPT_IDS

    return torch.tensor([PROMPT_IDS])


def _tolerance(bf16):
    return dict(atol=1e-5, rtol=0) if not bf16 else dict(atol=2e-2, rtol=0)  # bf16: identical weights, kernels may differ


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_full_export_gives_the_engines_logits(runs, bf16):
    from transformers import AutoModelForCausalLM

    tmp, _, _ = runs
    run = tmp / name(3, False, bf16) / "straight"
    want = torch.load(run / "engine_logits.pt")
    export = run / "export"
    assert (export / "config.json").exists() and (export / "tokenizer.model").exists()
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16 if bf16 else torch.float32)
    assert next(model.parameters()).dtype == (torch.bfloat16 if bf16 else torch.float32)
    with torch.no_grad():
        got = model(input_ids=_prompt()).logits.float()
    torch.testing.assert_close(got, want, **_tolerance(bf16))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_lora_adapter_and_merged_exports_give_the_engines_logits(runs, bf16):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp, _, _ = runs
    run = tmp / name(3, True, bf16) / "straight"
    dtype = torch.bfloat16 if bf16 else torch.float32
    want = torch.load(run / "engine_logits.pt")
    assert sorted(os.listdir(run / "export")) >= ["adapter_config.json", "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(tmp / "model", dtype=dtype)
    with_adapter = PeftModel.from_pretrained(base, run / "export").eval()
    merged = AutoModelForCausalLM.from_pretrained(run / "merged", dtype=dtype).eval()
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(input_ids=_prompt()).logits.float(), want, **_tolerance(bf16))
        torch.testing.assert_close(merged(input_ids=_prompt()).logits.float(), want, **_tolerance(bf16))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_offline_export_of_a_checkpoint(runs, tmp_path, lora):
    """`zerotune export RUN_DIR --out DIR [--merge]` from the resumed run's last checkpoint = the straight run's engine."""
    from transformers import AutoModelForCausalLM

    from finetune.export.weights import main as export_main

    tmp, _, _ = runs
    n = name(3, lora, False)
    out = tmp_path / "exported"
    assert export_main([str(tmp / n / "halves"), "--out", str(out)] + (["--merge"] if lora else [])) == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(input_ids=_prompt()).logits.float()
    torch.testing.assert_close(got, torch.load(tmp / n / "straight" / "engine_logits.pt"), atol=1e-5, rtol=0)



@pytest.mark.parametrize("moment", ["training", "saving"])
def test_kill_9_then_resume_continues_the_uninterrupted_curve(runs, tmp_path, moment):
    """kill -9 of every rank mid-run (after the step-4 checkpoint) or in the middle of writing a checkpoint; resume=auto
    continues from the last complete checkpoint with the uninterrupted run's losses, bit for bit."""
    tmp, losses, _ = runs
    n = name(3, False, False)
    straight = losses[f"{n}/straight"]
    out = tmp_path / "run"
    args = ["--deepspeed", str(tmp / "z3-False.json"), "--config", TINY_RECIPE, f"model.path={tmp / 'model'}",
            f"model.tokenizer={SMALL_VOCAB}", "lora.enabled=false", "data.max_seq_len=128", "optim.lr=1e-3",
            "optim.warmup_steps=3", f"train.max_steps={STEPS}", "train.micro_batch_size=1", "train.grad_accum=2",
            "train.sample_prompt=null", "train.log_every=100", "train.save_every=2", "train.export=false",
            f"train.output_dir={out}"]
    ckpts = out / "checkpoints"
    if moment == "training":
        until = (ckpts / "step_00000004" / checkpoint.MARKER).exists
    else:
        until = (ckpts / ".tmp-step_00000004").exists
    kill_two_ranks_when(args, f"{out}.rank", until)
    last = checkpoint.find_latest(str(out))
    assert last is not None
    resumed_from = int(last.rsplit("_", 1)[1])
    assert resumed_from == 2 if moment == "saving" else resumed_from >= 4
    # At once, as a quick retry would: a killed rank's lock, held until a write it was in has ended, is waited for
    # (finetune/run/folder_lock.py: RELEASE_WAIT_S).
    run_ranks(2, "finetune/main.py", args + ["train.resume=auto"], timeout=600)
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in metrics] == straight
    assert not list(ckpts.glob(".tmp-*")), "the half-written checkpoint is cleaned up by the next save of that step"
