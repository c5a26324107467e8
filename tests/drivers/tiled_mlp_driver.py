"""tests/drivers/parity_driver.py's trainings with finetune/perf/tiled_mlp.py's tile set by each case (`tile_tokens`),
so that the tiny model's short rows run several tiles; each result also counts the MLPs that ran tiled.

    tests/drivers/tiled_mlp_driver.py OUT.json CASES.json   (started by tests.helpers.run_ranks)
"""

from finetune.perf import tiled_mlp
from tests.drivers import parity_driver
from tests.helpers import driver_main


def one_case(case: dict) -> dict:
    tiled_mlp.TILE_TOKENS = case["tile_tokens"]
    counted = {"tiled_mlp_calls": 0}
    forward = tiled_mlp.TiledMLPFunction.forward

    def counting(ctx, *args):  # the tiled function ran (under grad), not only its installation
        counted["tiled_mlp_calls"] += 1
        return forward(ctx, *args)

    tiled_mlp.TiledMLPFunction.forward = staticmethod(counting)
    try:
        result = parity_driver.one_case(case)
    finally:
        tiled_mlp.TiledMLPFunction.forward = staticmethod(forward)
    return {**result, **counted}


if __name__ == "__main__":
    driver_main(one_case)
