"""Sequence parallelism (train.sequence_parallel, finetune/parallel/) against one rank that holds whole rows.

Acceptance, fp32: sequence_parallel=2 on 2 ranks, and 2 x 2 data-parallel on 4 ranks, give the losses, gradient
norms and eval losses of sequence_parallel=1 on 1 rank with the same global batch (1e-5), under ZeRO-2 and ZeRO-3,
LoRA and full, with packed rows longer than a rank's slice (tests/unit/test_sequence_parallel.py checks that every
slice holds parts of several samples) and activation checkpointing (the all-to-all runs again in the recomputation).
A resume under sequence parallelism continues bit-exactly; a checkpoint saved under it resumes on one rank. Each
world size is one launch of tests/drivers/sequence_parallel_driver.py running all of its cases.
"""

import json
import os

import pytest
import torch

from tests.fixtures.sequence_parallel_cases import overrides
from tests.helpers import ROOT, TINY_RECIPE, ds_variant, run_ranks, save_tiny_model

CASES = [(stage, lora) for stage in (2, 3) for lora in (False, True)]
TOLERANCE = 1e-5
EXPORT_AND_SAMPLE = ("train.export=true", "train.sample_prompt=What does ZeRO stage 3 partition?",
                     "train.sample_max_new_tokens=4")


def name(stage: int, lora: bool, tag: str) -> str:
    return f"zero{stage}-{'lora' if lora else 'full'}-{tag}"


def _launch(world: int, cases: list[dict], tmp) -> dict:
    cases_file, out = tmp / f"cases{world}.json", tmp / f"out{world}.json"
    cases_file.write_text(json.dumps(cases))
    run_ranks(world, os.path.join(ROOT, "tests", "drivers", "sequence_parallel_driver.py"),
              [str(out), str(cases_file)], timeout=1500)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case's records, by world size and name. Two ranks run first: the one-rank launch also resumes a
    checkpoint they saved."""
    tmp = tmp_path_factory.mktemp("sp")
    model_dir = save_tiny_model(str(tmp / "model"))
    ds = {stage: ds_variant(f"zero{stage}", str(tmp / f"zero{stage}.json"), bf16=False) for stage in (2, 3)}

    def case(world, stage, lora, tag, sp, **kw):
        return {"name": name(stage, lora, tag), "config": TINY_RECIPE, "deepspeed": ds[stage],
                "overrides": overrides(model_dir, str(tmp / f"w{world}" / name(stage, lora, tag)), lora, sp,
                                       world // sp, **kw)}

    saved = os.path.join(str(tmp / "w2" / name(3, True, "sp2")), "checkpoints", "step_00000002")
    # ZeRO-3 LoRA also saves (resumed below); ZeRO-3 full also samples and exports, outside the split rows.
    extra = {(3, True): ("train.save_every=2",), (3, False): EXPORT_AND_SAMPLE}
    two = [case(2, s, lo, "sp2", 2, extra=extra.get((s, lo), ())) for s, lo in CASES]
    two.append(case(2, 3, True, "resumed", 2, extra=(f"train.resume={saved}",)))
    results = {2: _launch(2, two, tmp)}
    one = [case(1, s, lo, "flex", 1, extra=EXPORT_AND_SAMPLE if (s, lo) == (3, False) else ()) for s, lo in CASES]
    one += [case(1, s, lo, "sdpa", 1, attn="sdpa") for s, lo in CASES]
    one.append(case(1, 3, True, "from-sp2", 1, extra=(f"train.resume={saved}",)))
    results[1] = _launch(1, one, tmp)
    # 2 data-parallel x 2 sequence-parallel, and 4 sequence-parallel ranks (more than the tiny model's 2 key/value
    # heads: each rank gets a copy of one).
    four = [case(4, 2, False, "sp2", 2), case(4, 3, True, "sp2", 2), case(4, 3, False, "sp4", 4)]
    results[4] = _launch(4, four, tmp)
    results["dirs"] = {world: str(tmp / f"w{world}") for world in (1, 2)}
    return results


def _same(got: dict, want: dict, what: str) -> None:
    for key in ("loss", "grad_norm", "eval_loss"):
        assert len(got[key]) == len(want[key]) > 0, f"{what}: {key}"
        assert got[key] == pytest.approx(want[key], abs=TOLERANCE, rel=0), f"{what}: {key}"
    # The rows' tokens and targets are counted once, whatever the number of ranks that share them.
    assert got["tokens"] == want["tokens"] and got["target_tokens"] == want["target_tokens"], what


@pytest.mark.parametrize("stage,lora", CASES, ids=[name(s, lo, "") for s, lo in CASES])
def test_two_sequence_parallel_ranks_equal_one_rank(runs, stage, lora):
    got = runs[2][name(stage, lora, "sp2")]
    assert got["sequence_parallel"] == 2 and got["attention"] == "zerotune_ulysses"
    _same(got, runs[1][name(stage, lora, "flex")], "sequence_parallel=2 vs 1 rank (flex)")
    _same(got, runs[1][name(stage, lora, "sdpa")], "sequence_parallel=2 vs 1 rank (transformers' sdpa)")
    one = runs[1][name(stage, lora, "flex")]["loss"]
    assert one[-1] < one[0] - 0.05, "the reference must be learning, or the comparison proves little"


@pytest.mark.parametrize("stage,lora,tag", [(2, False, "sp2"), (3, True, "sp2"), (3, False, "sp4")])
def test_four_ranks_equal_one_rank(runs, stage, lora, tag):
    got = runs[4][name(stage, lora, tag)]
    assert got["sequence_parallel"] == int(tag[2:])
    _same(got, runs[1][name(stage, lora, "flex")], f"4 ranks, sequence_parallel={tag[2:]} vs 1 rank")


def test_resume_under_sequence_parallelism_is_bit_exact(runs):
    straight, resumed = runs[2][name(3, True, "sp2")], runs[2][name(3, True, "resumed")]
    assert resumed["loss"] == straight["loss"][2:] and resumed["grad_norm"] == straight["grad_norm"][2:]
    # The checkpoint names every rank as its world: its ZeRO partitions span all of them.
    assert straight["saved_world_size"] == 2


def test_a_sequence_parallel_checkpoint_resumes_on_one_rank(runs):
    straight, resumed = runs[2][name(3, True, "sp2")], runs[1][name(3, True, "from-sp2")]
    assert resumed["loss"] == pytest.approx(straight["loss"][2:], abs=TOLERANCE, rel=0)


def test_sample_and_export_after_sequence_parallel_training(runs):
    """After training under sequence parallelism every rank holds whole rows again: the sample is generated as on
    one rank, and the export is the one-rank run's model (a Hugging Face folder that loads as it is)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    case = name(3, False, "")
    folders = {world: os.path.join(runs["dirs"][world], case + ("sp2" if world == 2 else "flex"))
               for world in (1, 2)}
    samples = {world: [json.loads(line) for line in open(os.path.join(f, "samples.jsonl"))]
               for world, f in folders.items()}
    assert [s["answer"] for s in samples[2]] == [s["answer"] for s in samples[1]] and len(samples[2]) == 2
    weights = {world: load_file(os.path.join(f, "export", "model.safetensors")) for world, f in folders.items()}
    assert weights[2].keys() == weights[1].keys()
    for key, value in weights[2].items():
        assert torch.allclose(value, weights[1][key], atol=TOLERANCE, rtol=0), key
    model = AutoModelForCausalLM.from_pretrained(os.path.join(folders[2], "export"))
    assert model.config._attn_implementation != "zerotune_ulysses"
