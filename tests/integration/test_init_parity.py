"""A random init (model.path with config.json only, model.init_seed) is the same model on every ZeRO stage and world
size: fp32 runs of the tiny recipe under ZeRO-2 and ZeRO-3 on 2 ranks, with no saved init, lose the same from step 1.
The values themselves, on any world size's partitions, are tests/unit/test_init_weights.py. LoRA's adapters are drawn
by peft after the base is built, outside zero.Init, from init_seed + 1: the same on every stage already
(tests/integration/test_parity.py)."""

import math

from tests.helpers import SMALL_VOCAB, TINY_RECIPE, ds_variant, train_cases

STEPS = 4


def _cases(tmp) -> list[dict]:
    cases = []
    for stage in (2, 3):
        # nothing kept whole under ZeRO-3: every parameter of the tiny model is partitioned (FACTS.md)
        zero3 = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
        ds = ds_variant(f"zero{stage}", str(tmp / f"zero{stage}.json"), bf16=False, **zero3)
        cases.append({"name": f"zero{stage}", "config": TINY_RECIPE, "deepspeed": ds, "overrides": [
            # the small-vocabulary config.json and tokenizer: no weights in the folder, so a random init
            f"model.path={SMALL_VOCAB}", f"model.tokenizer={SMALL_VOCAB}", "model.random_init=true", "model.init_seed=3",
            "lora.enabled=false", "data.max_seq_len=128", "optim.lr=1e-3", "optim.warmup_steps=2",
            f"train.max_steps={STEPS}", "train.micro_batch_size=2", f"train.output_dir={tmp / f'zero{stage}'}",
            "train.sample_prompt=null", "train.export=false"]})
    return cases


def test_zero2_and_zero3_train_the_same_random_init(tmp_path):
    got = train_cases(2, _cases(tmp_path), tmp_path)
    z2, z3 = got["zero2"]["loss"], got["zero3"]["loss"]
    assert len(z2) == len(z3) == STEPS
    assert abs(z2[0] - math.log(512)) < 0.1  # a random init of the 512-token model: near-uniform predictions
    assert z2[-1] < z2[0]  # it trained
    assert max(abs(a - b) for a, b in zip(z2, z3)) < 1e-5, (z2, z3)
