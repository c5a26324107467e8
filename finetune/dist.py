"""The one home of rank helpers: who am I, start the process group, sum or average across ranks.

    from finetune import dist
    dist.init()                      # once per process, before deepspeed.initialize
    mean_loss = dist.all_reduce_sum(total) / dist.all_reduce_sum(count)
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from typing import TYPE_CHECKING

from finetune.run import console

# torch and deepspeed are imported inside the functions that use them: the launcher (finetune/multinode) and the
# tokenizer worker processes (finetune/data/cache.py) import this module and must start without them.
if TYPE_CHECKING:
    import torch


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def adopt_openmpi_env() -> None:
    """Under `mpirun`, take RANK/WORLD_SIZE/LOCAL_RANK from OpenMPI before DeepSpeed looks.

    DeepSpeed's own MPI discovery compares hostnames and breaks when two "nodes" report the same one
    (LOCAL_RANK (1) != OMPI_COMM_WORLD_LOCAL_RANK (0)), then hangs; setting the variables ourselves
    makes it take the plain env:// path. MASTER_ADDR/PORT come from the launcher's environment.
    """
    if "OMPI_COMM_WORLD_RANK" not in os.environ or "RANK" in os.environ:
        return
    os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
    os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
    os.environ["LOCAL_RANK"] = os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise RuntimeError(
            "launched by mpirun without MASTER_ADDR/MASTER_PORT: use `zerotune launch --launcher openmpi`, "
            "or export both (-x MASTER_ADDR=<first host> -x MASTER_PORT=<free port>)"
        )


def init(timeout_minutes: float = 30.0) -> None:
    """Start the process group once (gloo on CPU, nccl on GPU), with a bounded timeout so a lost rank ends the job."""
    import deepspeed  # lazy: the launcher and tokenizer workers import dist without torch
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    adopt_openmpi_env()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if world_size() > 1:
            raise RuntimeError("WORLD_SIZE > 1 but MASTER_PORT is not set: start the job with `deepspeed` or `zerotune launch`")
        os.environ["MASTER_PORT"] = str(free_port())
    if deepspeed.get_accelerator().device_name() == "cpu" and (local := _local_size()):
        # DeepSpeed's CPU accelerator counts its devices from LOCAL_SIZE, which only DeepSpeed's own launcher sets;
        # without it each device_count() runs `numactl --hardware` in a subprocess, and ZeRO-3 asks once per
        # gradient bucket (a fork of the whole training process each time).
        os.environ.setdefault("LOCAL_SIZE", local)
    with console.quiet_stdout():  # DeepSpeed prints its CPU shm op's build line on every rank
        deepspeed.init_distributed(
            dist_init_required=True,
            auto_mpi_discovery=False,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    accelerator = deepspeed.get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_rank())
    else:
        _unlink_shm_workspace()


def _local_size() -> str | None:
    """How many ranks this node runs, from the launcher's variables (torchrun's, OpenMPI's), or 1 for a lone process;
    None when no launcher said."""
    for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(name):
            return os.environ[name]
    return "1" if world_size() == 1 else None


def shm_workspace_path(rank_: int) -> str:
    """Where DeepSpeed's CPU shm all-reduce keeps a rank's workspace (its shm.cpp names it so)."""
    return (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
            f"{os.environ.get('MASTER_PORT')}_{rank_}")


def _unlink_shm_workspace() -> None:
    """DeepSpeed's CPU shm all-reduce creates a file per rank in /dev/shm, the size of its all-reduce workspace (tens
    of MB: struct allreduce_workspace in its csrc/cpu/comm/shm.cpp), and never unlinks it, so every CPU run left them
    behind until /dev/shm (which is RAM) filled. init_distributed returns on a rank only after it has
    mapped every peer's workspace, so after a barrier the names can go: the mappings stay valid until the process
    exits, and a run that is killed leaves nothing behind either."""
    barrier()
    try:
        os.unlink(shm_workspace_path(rank()))
    except FileNotFoundError:  # the op was not built (DS_BUILD_SHM_COMM=0, tests) or ranks are on several hosts
        pass


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at `address` (a loopback address) right now."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def local_gpus() -> list[float]:
    """Total memory in bytes of each CUDA device this process sees; [] without CUDA."""
    import torch  # lazy: the launcher and tokenizer workers import dist without torch

    if not torch.cuda.is_available():
        return []
    return [float(torch.cuda.get_device_properties(i).total_memory) for i in range(torch.cuda.device_count())]


def device() -> torch.device:
    import deepspeed  # lazy: the launcher and tokenizer workers import dist without torch
    import torch

    accelerator = deepspeed.get_accelerator()
    if accelerator.device_name() == "cpu":
        return torch.device("cpu")
    return torch.device(accelerator.device_name(), local_rank())


def all_reduce_sum(value: float | torch.Tensor) -> torch.Tensor:
    """Sum a scalar or tensor over all ranks (a float64 copy; the input is left alone)."""
    import torch  # lazy: the launcher and tokenizer workers import dist without torch

    t = torch.as_tensor(value, dtype=torch.float64).clone().detach()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        backend_device = device()
        t = t.to(backend_device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
        t = t.cpu()
    return t


def all_reduce_max(value: float) -> float:
    return all_reduce_max_each([value])[0]


def all_reduce_max_each(values: list[float]) -> list[float]:
    """The maximum over all ranks of each value, in one collective."""
    import torch  # lazy: the launcher and tokenizer workers import dist without torch

    t = torch.tensor(values, dtype=torch.float64)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        t = t.to(device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.cpu().tolist()


def all_gather_object(obj: object) -> list:
    """Every rank's `obj` (anything picklable), in rank order, on every rank; [obj] without a process group."""
    import torch  # lazy: the launcher and tokenizer workers import dist without torch

    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        out: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(out, obj)
        return out
    return [obj]


def barrier() -> None:
    import torch  # lazy: the launcher and tokenizer workers import dist without torch

    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def shutdown() -> None:
    """Leave the process group cleanly at the end of a run: exiting with gloo's threads still running can end the
    process with `terminate called without an active exception` (SIGABRT) after a successful run."""
    import torch  # lazy: the launcher and tokenizer workers import dist without torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        barrier()
        torch.distributed.destroy_process_group()


def exit_process(code: int) -> None:
    """End a rank right after shutdown(), skipping the interpreter's teardown. Even after destroy_process_group, a
    finished rank now and then died in teardown with `terminate called without an active exception` (SIGABRT, exit
    250 under the launcher; seen in CI and in a 2-rank compare on CPU): a C++ thread (gloo's, or an op's) destroyed
    while joinable. Every file the run writes is closed by then; only the standard streams need flushing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# How long a rank other than local rank 0 holds back an error every rank meets: a launcher (deepspeed, mpirun, srun)
# stops the whole job as soon as local rank 0 exits with it, so the error is printed once.
QUIET_EXIT_DELAY_S = 10.0


def report_error(message: str) -> None:
    """Print `zerotune: error: MESSAGE` once per node for an error every rank meets alike (a recipe checked before
    any process group exists): local rank 0 at once; another rank only if it is still running QUIET_EXIT_DELAY_S
    later, i.e. when no launcher ended the job for local rank 0, which then did not meet the error."""
    if local_rank() != 0:
        time.sleep(QUIET_EXIT_DELAY_S)
    console.error(message)


def print0(*args, **kwargs) -> None:
    """Print on rank 0 only, flushed (logs of several ranks interleave otherwise)."""
    if is_main():
        print(*args, **kwargs, flush=True)
