"""finetune/dist.py's environment for DeepSpeed's CPU accelerator: LOCAL_SIZE (the ranks on this node) from whichever
launcher started the process, because without it every device_count() of DeepSpeed's CPU accelerator runs
`numactl --hardware` in a subprocess, and ZeRO-3 asks once per gradient bucket."""

import subprocess

import pytest

from finetune import dist

LAUNCHER_VARS = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "WORLD_SIZE")


@pytest.mark.parametrize("env, want", [
    ({"LOCAL_SIZE": "3", "LOCAL_WORLD_SIZE": "2"}, "3"),  # DeepSpeed's launcher: kept
    ({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}, "2"),  # torchrun, the tests' rank starter
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "WORLD_SIZE": "8"}, "4"),  # mpirun
    ({}, "1"),  # one process, no launcher
    ({"WORLD_SIZE": "4"}, None),  # ranks, but no launcher said how many share this node: DeepSpeed's own count
])
def test_local_size_from_the_launchers_variables(monkeypatch, env, want):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert dist._local_size() == want


def test_with_local_size_the_cpu_accelerator_counts_without_a_subprocess(monkeypatch):
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"a subprocess was started: {args}")

    monkeypatch.setattr(subprocess, "check_output", no_subprocess)
    monkeypatch.setenv("LOCAL_SIZE", "2")
    assert CPU_Accelerator().device_count() == 2
    monkeypatch.delenv("LOCAL_SIZE")
    with pytest.raises(AssertionError, match="numactl"):
        CPU_Accelerator().device_count()
