"""The launch plan: the hosts, the exact command and the environment a multi-node job runs with.

    plan = launcher.build_plan(args, train_args, os.environ); print(plan.shell_command()); jobwatch.run_job(plan, grace=20)
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from finetune.multinode.preflight import Transport


@dataclass
class LaunchPlan:
    """Everything `main` prints in a dry run and then runs."""

    launcher: str
    hosts: dict[str, list[int]]
    hostfile: str
    hostfile_text: str | None
    """Text written to `hostfile` before the launch (Slurm, or a filtered one for OpenMPI); None: the user's file."""
    master_addr: str
    master_port: int
    local: bool
    """One host that is this machine: DeepSpeed starts its ranks without ssh."""
    command: list[str]
    command_env: dict[str, str]
    """Variables for the command itself, printed as its prefix."""
    env_file_text: str
    train_args: list[str]

    def ranks(self) -> dict[str, list[int]]:
        """Global ranks per host, in hostfile order (the order DeepSpeed and mpirun give them)."""
        out, start = {}, 0
        for host, slots in self.hosts.items():
            out[host] = list(range(start, start + len(slots)))
            start += len(slots)
        return out

    def transport(self) -> Transport:
        """How the preflight reaches the hosts: not at all for this machine, srun under Slurm, else ssh."""
        return Transport("local" if self.local else "srun" if self.launcher == "slurm" else "ssh")

    def exports(self) -> dict[str, str]:
        """The .deepspeed_env variables; also set for the command, as the one-host and Slurm paths skip the file."""
        return dict(line.split("=", 1) for line in self.env_file_text.splitlines())

    def shell_command(self) -> str:
        return " ".join([f"{k}={shlex.quote(v)}" for k, v in self.command_env.items()] + [shlex.join(self.command)])
