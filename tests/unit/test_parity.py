"""What the oracle matrix (tests/integration/test_parity.py) relies on: the micro-batches of a step hold different
numbers of target tokens, so 1 rank x accumulation 2 against 2 ranks x accumulation 1 tests the loss normalisation.
`overrides` (tests/fixtures/parity_cases.py) is the recipe every case of the matrix trains."""

from tests.fixtures.parity_cases import STEPS, overrides
from tests.helpers import SMALL_VOCAB, TINY_RECIPE


def test_micro_batches_hold_different_target_counts(tmp_path):
    """The accumulation test above means something only if micro-batches differ in trained tokens."""
    from finetune.config import load_recipe
    from finetune.data import build_datasets
    from finetune.data.loader import StepLoader
    from finetune.data.tokenizer import load_tokenizer

    recipe = load_recipe(TINY_RECIPE, overrides(SMALL_VOCAB, str(tmp_path / "o"), False, 1))
    tok = load_tokenizer(SMALL_VOCAB)
    data, _, _ = build_datasets(recipe.data, tok, recipe.train.seed, str(tmp_path / "cache"))
    loader = StepLoader(data, 2, 2, 1, 0, recipe.data.max_seq_len, True, recipe.train.seed, tok.pad_id)
    uneven = 0
    for step in range(STEPS):
        counts = [int((mb["targets"] != -100).sum()) for mb in loader.step(step)]
        uneven += counts[0] != counts[1]
    assert uneven >= STEPS // 2


