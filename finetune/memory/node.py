"""What this node has for a run: its CPU memory (under its cgroup's limit), the ranks that share it, this rank's GPU.

    total, available = host_memory()      # bytes, or None where /proc/meminfo cannot be read
    ranks_per_node(world)                 # the launcher's LOCAL_WORLD_SIZE, else every rank
"""

from __future__ import annotations

import os

from finetune import dist
from finetune.memory.estimate import GIB


def host_memory(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> tuple[float | None, float | None]:
    """(total, available) bytes of CPU memory for this job: MemTotal and MemAvailable, each capped by the cgroup's
    limit (a container or a Slurm job sees the node's MemTotal but may use only its limit); None where unreadable."""
    values = {}
    try:
        with open(meminfo) as f:
            for line in f:
                key, _, rest = line.partition(":")
                values[key] = float(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None, None
    total, available = values.get("MemTotal"), values.get("MemAvailable")
    for limit_file in ("memory.max", "memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            with open(os.path.join(cgroup, limit_file)) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit() and total is not None and int(limit) < total:
            total = float(limit)
            available = min(available, total) if available is not None else None
    return total, available


def ranks_per_node(world: int) -> int:
    """Ranks sharing this node's memory: the launcher's LOCAL_WORLD_SIZE / LOCAL_SIZE, else every rank."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return world


def local_gpu_gib() -> float | None:
    """Memory of this rank's GPU in GiB, or None on a machine without CUDA."""
    gpus = dist.local_gpus()
    return gpus[dist.local_rank() % len(gpus)] / GIB if gpus else None
