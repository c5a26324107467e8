"""Launch training on the hosts of a hostfile: check every host, write the job's .deepspeed_env into a temporary
folder (DS_ENV_FILE names it to DeepSpeed's runner; removed when the job ends, so a launch leaves nothing in the current
folder), run the exact `deepspeed` command, and end the whole job, naming the rank and host, when one rank is lost.

    zerotune launch --hostfile hostfiles/my_nodes -- --deepspeed ds_configs/zero3.json --config recipes/x.yaml

`python -m finetune.multinode.launcher ...` does the same. Hostfiles and filters: finetune/multinode/hostfile.py; checks: preflight.py, doctor.py.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import shutil
import socket
import sys
import tempfile

from finetune.multinode.hostfile import (
    HostfileError,
    address_of,
    filter_hosts,
    format_hostfile,
    is_loopback,
    load_hostfile,
    slurm_hosts,
    written_as_read,
)
from finetune import shipped
from finetune.config import ConfigError, load_recipe
from finetune.dist import free_port
from finetune.multinode.doctor import doctor_command, run_doctor
from finetune.multinode.jobwatch import SAVE_WAIT_S, run_job, span
from finetune.multinode.plan import LaunchPlan
from finetune.multinode.preflight import run_preflight
from finetune.parallel.degree import check_world
from finetune.run import console

REPO = shipped.IMPORT_ROOT  # the folder holding this `finetune` package: the checkout, or site-packages
DEFAULT_SCRIPT = os.path.join(shipped.PACKAGE, "main.py")
ENV_FILE = ".deepspeed_env"  # the name DeepSpeed's runner reads in the home and current folders (DS_ENV_FILE renames it)
FORWARD_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "FI_", "UCX_", "HF_", "WANDB_", "ZEROTUNE_", "TRITON_", "OMP_")
FORWARD_NAMES = (
    "TORCH_EXTENSIONS_DIR", "TRANSFORMERS_OFFLINE", "CUDA_HOME", "LD_LIBRARY_PATH", "PYTORCH_CUDA_ALLOC_CONF",
    "CUDA_DEVICE_MAX_CONNECTIONS", "TORCH_DISTRIBUTED_DEBUG", "TOKENIZERS_PARALLELISM", "DS_ACCELERATOR",
)
SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|CREDENTIAL")
PDSH_SSH_ARGS = "-o BatchMode=yes -o ServerAliveInterval=10 -o ServerAliveCountMax=6"  # a vanished host: pdsh ends



class LaunchError(RuntimeError):
    """A launch the user must fix before anything starts; the message says what to do."""


def main(argv: list[str] | None = None) -> int:
    """`zerotune launch ...`; returns the exit code (0: the job succeeded, or the dry run printed)."""
    args, train_args = _parse_args(sys.argv[1:] if argv is None else argv)
    try:
        plan = build_plan(args, train_args, dict(os.environ))
    except (LaunchError, HostfileError) as e:
        return _fail(str(e), 2)
    if args.doctor:  # the doctor's command is the one printed and run; no training follows
        plan.command = doctor_command(plan, quick=False, timeout=args.doctor_timeout)
    env_dir = None if args.dry_run else tempfile.mkdtemp(prefix="zerotune-launch-")
    try:
        return _start(args, plan, env_dir)
    finally:
        if env_dir is not None:
            shutil.rmtree(env_dir, ignore_errors=True)


def _start(args: argparse.Namespace, plan: LaunchPlan, env_dir: str | None) -> int:
    """Print the plan; unless it is a dry run, check the hosts and run the job with its .deepspeed_env in env_dir
    (the user's own files, in the home and current folders, are read by build_plan, never written)."""
    env_file = ENV_FILE
    if env_dir is not None:
        env_file = os.path.join(env_dir, ENV_FILE)
        plan.command_env["DS_ENV_FILE"] = env_file  # an absolute path: the runner reads it instead of ~/ and ./
    layout = "; ".join(f"{host}: {span(ranks)}" for host, ranks in plan.ranks().items())
    print(f"zerotune launch: {len(plan.hosts)} host(s), ranks {layout}; launcher {plan.launcher}, "
          f"master {plan.master_addr}:{plan.master_port}")
    if plan.hostfile_text is not None:
        print(f"{plan.hostfile}:\n{plan.hostfile_text}", end="")
    print(f"$ {plan.shell_command()}\n{env_file}:\n{plan.env_file_text}", end="", flush=True)
    if args.dry_run:
        print("dry run: nothing started")
        return 0
    try:
        if not args.skip_preflight:
            report = run_preflight(
                {host: len(slots) for host, slots in plan.hosts.items()}, plan.transport(),
                output_dir=output_dir_of(plan.train_args), master_addr=plan.master_addr, master_port=plan.master_port,
            )
            print(report.table(), flush=True)
            if not report.ok:
                return _fail("preflight failed, nothing was started; fix the FAIL lines or pass --skip-preflight", 1)
        for path, text in [(env_file, plan.env_file_text), (plan.hostfile, plan.hostfile_text)]:
            if text is not None:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                with open(path, "w") as f:
                    f.write(text)
        if args.doctor or not args.no_doctor:
            # A short launch of its own through the same runner, hosts and .deepspeed_env, before training's: it
            # proves the launch path and the collectives under its own deadline and names a rank that never answers
            # (training would wait out its process-group timeout), at the cost of one runner start; train.py stays as is.
            command = plan.command if args.doctor else doctor_command(plan, quick=True, timeout=args.doctor_timeout)
            doctor = run_doctor(plan, command, timeout=args.doctor_timeout)
            print(doctor.table(), flush=True)
            if not doctor.ok:
                then = "; fix the FAIL lines" if args.doctor else ", nothing was trained; fix the FAIL lines or pass --no-doctor"
                return _fail(f"the doctor found a problem{then}", 1)
            if args.doctor:
                return 0
    except (LaunchError, OSError) as e:
        return _fail(str(e), 2)
    return run_job(plan, grace=args.failure_grace, save_wait=args.stop_timeout)


def _fail(message: str, code: int) -> int:
    console.error(message)
    return code


def _parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        prog="zerotune launch",
        description="Run finetune/main.py on the hosts of a hostfile through DeepSpeed's runner.",
        epilog="After `--`: finetune/main.py's arguments, e.g. -- --deepspeed ds_configs/zero3.json --config x.yaml",
    )
    add = parser.add_argument
    add("--hostfile", help="`HOST slots=N` lines; with --launcher slurm, where to write the one built from the job")
    add("--launcher", choices=("pdsh", "openmpi", "slurm"), default="pdsh")
    add("--include", default="", help="DeepSpeed syntax, e.g. `node1:0,1@node2` (whole hosts only for openmpi)")
    add("--exclude", default="", help="DeepSpeed syntax, e.g. `node3` or `node1:7`")
    add("--dry-run", action="store_true", help="print the command and .deepspeed_env, start nothing")
    add("--skip-preflight", action="store_true", help="launch without checking the hosts first")
    add("--doctor", action="store_true", help="only check: the preflight, then a timed all-reduce and all-to-all on "
        "every rank (bus bandwidth and latency per node); exit 0 when all is well")
    add("--no-doctor", action="store_true", help="skip the quick doctor run (one small all-reduce and all-to-all) "
        "that precedes training")
    add("--doctor-timeout", type=float, default=60.0, help="seconds a doctor rank waits for its peers")
    add("--master-port", type=int, default=0, help="default: a free port")
    add("--master-addr", default="", help="default: the first host's address, as ssh resolves it")
    add("--launcher-args", default="", help="extra arguments for pdsh, mpirun or srun, as one quoted string")
    add("--failure-grace", type=float, default=20.0, help="seconds the other ranks get to stop after one fails")
    add("--stop-timeout", type=float, default=SAVE_WAIT_S, help="seconds the ranks get to save and exit when this "
        "launcher receives SIGTERM or SIGUSR1 (passed on to them) before the job is stopped")
    add("--script", default=DEFAULT_SCRIPT, help="(advanced) the entry point to launch instead of finetune/main.py")
    return parser.parse_args(argv[:split]), argv[split + 1 :]


def build_plan(args: argparse.Namespace, train_args: list[str], environ: dict[str, str]) -> LaunchPlan:
    """Resolve hosts, master address and port, the command and the .deepspeed_env text; writes and runs nothing."""
    script = args.script
    if train_args and train_args[0].endswith(".py"):  # `-- finetune/main.py --deepspeed ...` works too
        script, train_args = train_args[0], train_args[1:]
    script = os.path.abspath(script)
    if script.startswith(os.getcwd() + os.sep):
        script = os.path.relpath(script)
    hosts, hostfile, hostfile_text = _select_hosts(args, environ)
    check_sequence_parallel(train_args, sum(map(len, hosts.values())))
    first = next(iter(hosts))
    master_addr = args.master_addr or (first if args.launcher == "slurm" else address_of(first))
    loopback = args.launcher != "slurm" and all(is_loopback(address_of(host)) for host in hosts)
    local = args.launcher == "pdsh" and len(hosts) == 1 and (loopback or first == socket.gethostname())
    master_port = args.master_port or free_port()
    deepspeed = [_deepspeed(), "--hostfile", hostfile, "--master_addr", master_addr, "--master_port", str(master_port)]
    if local or (not args.skip_preflight and args.launcher != "slurm"):
        deepspeed.append("--no_ssh_check")  # the preflight checked ssh, with a timeout; DeepSpeed's check has none
    extra, command_env = shlex.split(args.launcher_args), {}
    if args.launcher == "pdsh":
        deepspeed += ["--include", args.include] if args.include else []
        deepspeed += ["--exclude", args.exclude] if args.exclude else []
        if len(hosts) == 1 and not local:
            deepspeed.append("--force_multi")  # else DeepSpeed runs a one-host hostfile here, not on that host
        if not local:
            command_env["PDSH_SSH_ARGS_APPEND"] = f"{environ.get('PDSH_SSH_ARGS_APPEND', '')} {PDSH_SSH_ARGS}".strip()
        command = deepspeed + (["--launcher_args", shlex.join(extra)] if extra else [])
    elif args.launcher == "openmpi":
        world = sum(map(len, hosts.values()))  # the same on every rank; DeepSpeed's MPICH/IMPI runners set it too
        mpi = ["-x", f"MASTER_ADDR={master_addr}", "-x", f"MASTER_PORT={master_port}", "-x", f"WORLD_SIZE={world}"]
        mpi += ["--allow-run-as-root"] if _is_root() else []
        iface = "lo" if loopback else _plain_iface(environ)
        mpi += ["--mca", "btl_tcp_if_include", iface, "--mca", "oob_tcp_if_include", iface] if iface else []
        command = deepspeed + ["--launcher", "openmpi", "--force_multi", "--launcher_args", shlex.join(mpi + extra)]
    else:
        srun = ["srun", f"--nodes={len(hosts)}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
        if environ.get("SLURM_GPUS_ON_NODE") or environ.get("SLURM_GPUS_PER_NODE"):
            srun.append(f"--gpus-per-node={len(hosts[first])}")
        if environ.get("SLURM_CPUS_ON_NODE"):
            srun.append(f"--cpus-per-task={environ['SLURM_CPUS_ON_NODE']}")  # else the step's one task gets one core
        node_rank = ["bash", "-c", 'exec "$0" --node_rank="$SLURM_NODEID" "$@"']
        command = srun + extra + node_rank + deepspeed + ["--no_ssh"]
    user: dict[str, str] = {}
    for path in user_env_files(environ):
        user.update(_parse_env(_read(path), path))
    env_file_text = merge_env_file("", {**user, **build_exports(environ, loopback=loopback)})
    return LaunchPlan(args.launcher, hosts, hostfile, hostfile_text, master_addr, master_port, local,
                      command + [script, *train_args], command_env, env_file_text, train_args)


def _select_hosts(args: argparse.Namespace, environ: dict[str, str]) -> tuple[dict[str, list[int]], str, str | None]:
    """(hosts with their slot ids, the hostfile DeepSpeed reads, its text if we must write it first)."""
    if args.launcher == "slurm":
        if args.include or args.exclude:
            raise LaunchError("--include/--exclude do not apply to --launcher slurm: pick nodes in sbatch instead")
        hosts = filter_hosts(slurm_hosts(environ))
        path = args.hostfile or os.path.join("runs", f"slurm-{environ.get('SLURM_JOB_ID', 'job')}.hostfile")
        return hosts, path, format_hostfile(hosts)
    if not args.hostfile:
        raise LaunchError("--hostfile is required (hostfiles/localhost runs on this machine alone)")
    pool = load_hostfile(args.hostfile)
    hosts = filter_hosts(pool, args.include, args.exclude)
    if not written_as_read(args.hostfile) and (args.launcher != "openmpi" or hosts == filter_hosts(pool)):
        # `[::1]` written `::1`: DeepSpeed hands the names to pdsh as they are (and applies the filters itself)
        text = format_hostfile(filter_hosts(pool))
        return hosts, os.path.join("runs", f"hostfile-{hashlib.sha256(text.encode()).hexdigest()[:8]}"), text
    if args.launcher != "openmpi" or hosts == filter_hosts(pool):
        return hosts, args.hostfile, None
    if any(slots != list(range(pool[host])) for host, slots in hosts.items()):
        raise LaunchError("openmpi places ranks on whole hosts: filter hosts without `:slots`, or use pdsh")
    text = format_hostfile(hosts)  # mpirun takes no filter: give it a hostfile of the chosen hosts
    return hosts, os.path.join("runs", f"hostfile-{hashlib.sha256(text.encode()).hexdigest()[:8]}"), text


def build_exports(environ: dict[str, str], *, loopback: bool = False) -> dict[str, str]:
    """What every rank needs, from this environment: NCCL/GLOO/HF/... settings (never secrets), the venv's PATH,
    PYTHONPATH with the repo root. All hosts on loopback: GLOO/NCCL_SOCKET_IFNAME default to `lo`."""
    exports = {
        key: value for key, value in environ.items()
        if (key.startswith(FORWARD_PREFIXES) or key in FORWARD_NAMES) and not SECRET.search(key)
    }
    if loopback:
        exports.setdefault("GLOO_SOCKET_IFNAME", "lo")
        exports.setdefault("NCCL_SOCKET_IFNAME", "lo")
    exports["PATH"] = _join_paths(os.path.dirname(sys.executable), environ.get("PATH", ""))
    exports["PYTHONPATH"] = _join_paths(REPO, environ.get("PYTHONPATH", ""))
    return dict(sorted(exports.items()))


def user_env_files(environ: dict[str, str]) -> list[str]:
    """The files DeepSpeed's runner itself reads, in its order: DS_ENV_FILE's name (default .deepspeed_env) in the
    home folder, then in the current one. zerotune merges them into the job's own file."""
    name = environ.get("DS_ENV_FILE", ENV_FILE)
    paths = [os.path.join(os.path.expanduser("~"), name), os.path.join(".", name)]
    return list(dict.fromkeys(os.path.abspath(p) for p in paths))


def merge_env_file(existing: str, exports: dict[str, str]) -> str:
    """The user's KEY=VALUE lines kept in order, ours replacing a line of the same key or appended; blank lines
    dropped (DeepSpeed's runner crashes on them)."""
    lines = _parse_env(existing, ENV_FILE)
    lines.update(exports)
    return "".join(f"{key}={value}\n" for key, value in lines.items())


def _parse_env(text: str, name: str) -> dict[str, str]:
    lines: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise LaunchError(f"{name}:{number}: {line!r} is not KEY=VALUE, which DeepSpeed's runner needs; fix it")
        lines[key.strip()] = value
    return lines


def output_dir_of(train_args: list[str]) -> str:
    """train.output_dir as finetune/main.py will resolve it: a `train.output_dir=` override, else the recipe's."""
    config, overrides = _recipe_args(train_args)
    for item in reversed(overrides):
        if item.startswith("train.output_dir="):
            return item.partition("=")[2]
    try:
        return load_recipe(config, overrides).train.output_dir
    except ConfigError as e:
        raise LaunchError(f"cannot resolve train.output_dir for the preflight: {e}") from e


def check_sequence_parallel(train_args: list[str], world: int) -> None:
    """LaunchError when the recipe's train.sequence_parallel does not divide the `world` ranks of the hosts: every
    rank would stop on it after starting. A recipe that does not load is left for the ranks to report in full."""
    try:
        degree = load_recipe(*_recipe_args(train_args)).train.sequence_parallel
        if degree != "auto":
            check_world(int(degree), world)
    except ConfigError as e:
        if "sequence_parallel" in str(e):
            raise LaunchError(str(e)) from None


def _recipe_args(train_args: list[str]) -> tuple[str | None, list[str]]:
    """(--config, the section.key=value overrides) of finetune/main.py's arguments."""
    overrides = [a for a in train_args if "=" in a and not a.startswith("-")]
    config = next((a.partition("=")[2] for a in train_args if a.startswith("--config=")), None)
    if "--config" in train_args[:-1]:
        config = train_args[train_args.index("--config") + 1]
    return config, overrides


def _plain_iface(environ: dict[str, str]) -> str:
    """NCCL/GLOO_SOCKET_IFNAME when it names one interface (not a list, a prefix match or an exclusion)."""
    for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if re.fullmatch(r"[\w.]+", value := environ.get(key, "")):
            return value
    return ""


def _is_root() -> bool:
    return os.geteuid() == 0


def _deepspeed() -> str:
    """The venv's `deepspeed` beside this python, so an unactivated venv works too."""
    beside = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return beside if os.path.exists(beside) else "deepspeed"


def _join_paths(first: str, rest: str) -> str:
    return os.pathsep.join(dict.fromkeys([first] + [p for p in rest.split(os.pathsep) if p]))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
