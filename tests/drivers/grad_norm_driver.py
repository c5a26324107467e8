"""The ZeRO-1/2 gradient norm of the same gradients on 1 rank and split over 2, by DeepSpeed's own methods and by
finetune/model/optim.py's replacements (install_exact_grad_norm); writes how often the two world sizes agree.

    python tests/drivers/grad_norm_driver.py OUT.json CASES.json    (2 ranks; tests/integration/test_grad_norm.py)

A case: `trials` sets of fp32 gradient tensors, each flattened and cut in half by elements as ZeRO-1/2 partitions a
parameter group (the tensor across the cut split between the ranks); `nan` poisons one element on rank 1. Both methods
run on a stand-in for the optimizer with the attributes they read: the group is one rank's own for the 1-rank norm, the
world's for the 2-rank norm. Gloo on loopback.
"""

import types

import torch

from tests.helpers import driver_main


def _optimizer(group, norms: dict) -> types.SimpleNamespace:
    return types.SimpleNamespace(dp_process_group=group, model_parallel_rank=0, device="cpu",
                                 _model_parallel_all_reduce=lambda tensor, op: None, norm_for_param_grads=norms,
                                 get_param_id=id, ignore_unused_parameters=False)


def _partition(grads: list[torch.Tensor], params: list[torch.Tensor], rank: int):
    """This rank's half of the group's elements: its pieces of the gradients and their parameters."""
    total = sum(g.numel() for g in grads)
    lo, hi = (0, total // 2) if rank == 0 else (total // 2, total)
    pieces, owners, start = [], [], 0
    for g, p in zip(grads, params):
        a, b = max(lo, start), min(hi, start + g.numel())
        if a < b:
            pieces.append(g.view(-1)[a - start:b - start])
            owners.append(p)
        start += g.numel()
    return pieces, owners


def _norms(grads, params) -> dict:
    """What DeepSpeed's gradient hooks keep under CPU offload: each parameter's piece's norm, in float64."""
    return {id(p): torch.linalg.vector_norm(g.double()) for g, p in zip(grads, params)}


def one_case(case: dict) -> dict:
    from deepspeed import comm
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from finetune import dist
    from finetune.model import optim

    dist.init()
    rank = dist.rank()
    solo = [comm.new_group([r]) for r in range(2)][rank]  # every rank makes every group, in the same order
    methods = {
        "exact": (optim._grad_norm_direct, optim._grad_norm_offload),
        "deepspeed": (DeepSpeedZeroOptimizer.get_grad_norm_direct,
                      DeepSpeedZeroOptimizer.complete_grad_norm_calculation_for_cpu_offload),
    }
    out = {f"{name}_{path}": [] for name in methods for path in ("direct", "offload")}
    out["float64"] = []
    for trial in range(case["trials"]):
        gen = torch.Generator().manual_seed(trial)
        sizes = torch.randint(1, 3000, (6,), generator=gen).tolist()
        grads = [torch.randn(n, generator=gen) * 10 ** torch.empty(()).uniform_(-4, 0, generator=gen) for n in sizes]
        if case["nan"]:
            grads[-1][-1] = float("nan")  # in the second half: rank 1's
        params = [torch.empty(0) for _ in grads]
        pieces, owners = _partition(grads, params, rank)
        out["float64"].append(sum(g.double().square().sum() for g in grads).sqrt().item())
        for name, (direct, offload) in methods.items():
            one = direct(_optimizer(solo, {}), grads, params).item()
            two = direct(_optimizer(None, {}), pieces, owners).item()
            out[f"{name}_direct"].append([one, two])
            one = offload(_optimizer(solo, _norms(grads, params)), params).item()
            two = offload(_optimizer(None, _norms(pieces, owners)), owners).item()
            out[f"{name}_offload"].append([one, two])
    return out


if __name__ == "__main__":
    driver_main(one_case)
