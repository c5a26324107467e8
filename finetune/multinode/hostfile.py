"""Hostfiles in DeepSpeed's grammar, `--include/--exclude` filters, and hostfiles built from a Slurm allocation.

    pool = load_hostfile("hostfiles/two_nodes.example")          # {"node1": 8, "node2": 8}
    active = filter_hosts(pool, include="node1:0,1@node2")       # {"node1": [0, 1], "node2": [0, ..., 7]}
    address_of("node1")                                          # what ssh connects to, e.g. "10.0.0.11"

Stricter than DeepSpeed, which only warns on a missing hostfile and then trains on the local machine:
here a missing file, a line that is not `HOST slots=N`, a duplicate host, two lines that reach one machine
(`localhost` and `127.0.0.1`, a name and its address) or `slots` <= 0 is an error naming the file and line.
A bracketed IPv6 address (`[::1]`) is read as the bare one.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import subprocess

_LINE = re.compile(r"^(?P<host>[^\s#=]+)\s+slots\s*=\s*(?P<slots>-?\d+)\s*(?:#.*)?$")


class HostfileError(ValueError):
    """A hostfile, filter or Slurm allocation the user must fix; the message says where and how."""


def load_hostfile(path: str) -> dict[str, int]:
    """Read `HOST slots=N` lines (with `#` comments and blank lines) into an ordered {host: slots}; two lines that
    reach one machine are refused (see machine_of)."""
    if not os.path.isfile(path):
        raise HostfileError(
            f"hostfile {path!r} not found. Write one line per node, `HOST slots=N` "
            f"(see hostfiles/two_nodes.example), or use hostfiles/localhost for this machine alone"
        )
    with open(path) as f:
        entries = _parse_lines(f.read(), path)
    _refuse_one_machine_twice(entries, path)
    return {host: slots for _, host, slots in entries}


def parse_hostfile(text: str, path: str = "<hostfile>") -> dict[str, int]:
    """Parse hostfile text; errors read `PATH:LINE: what is wrong`. Looks no name up (load_hostfile does)."""
    return {host: slots for _, host, slots in _parse_lines(text, path)}


def _parse_lines(text: str, path: str) -> list[tuple[int, str, int]]:
    """(line number, host, slots) of each host line; a bracketed IPv6 address (`[::1]`) becomes the bare one, the
    form ssh and pdsh take (pdsh reads brackets as a host range)."""
    entries: list[tuple[int, str, int]] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise HostfileError(f"{path}:{number}: expected `HOST slots=N` (N = GPUs on that node), got {line!r}")
        host, slots = _unbracket(match["host"], f"{path}:{number}"), int(match["slots"])
        if slots <= 0:
            raise HostfileError(f"{path}:{number}: {host} has slots={slots}; slots is the number of ranks, at least 1")
        if host in first_line:
            raise HostfileError(
                f"{path}:{number}: {host} is listed twice (first on line {first_line[host]}); "
                f"give each host one line with its total slots"
            )
        entries.append((number, host, slots))
        first_line[host] = number
    if not entries:
        raise HostfileError(f"{path}: no hosts in the hostfile; add lines like `node1 slots=8`")
    return entries


def _unbracket(host: str, where: str) -> str:
    if not (host.startswith("[") or host.endswith("]")):
        return host
    inner = host[1:-1] if host.startswith("[") and host.endswith("]") else ""
    try:
        if ipaddress.ip_address(inner).version == 6:
            return inner
    except ValueError:
        pass
    raise HostfileError(f"{where}: {host!r}: brackets hold an IPv6 address (`[::1]`, `[fe80::1%eth0]`); write "
                        f"a host name or an IPv4 address without them")


def written_as_read(path: str) -> bool:
    """Whether DeepSpeed's runner, reading the file itself, sees the hosts load_hostfile gives (no bracketed
    address: those must reach it, and pdsh, bare)."""
    with open(path) as f:
        return not any(line.split()[0].startswith("[") for line in f if line.strip() and not line.lstrip().startswith("#"))


def machine_of(host: str) -> frozenset[str]:
    """What `host` reaches, as the preflight's ssh does: the ssh config's HostName for it (address_of), resolved
    by getaddrinfo to its addresses; 127.0.0.1, ::1 and every address of `localhost` or of this machine's name
    stand for "this machine". A name that does not resolve stands for itself (the preflight reports it
    unreachable). Two hosts reach one machine when their sets meet.

    Another loopback address (127.0.0.2, ...) stays its own: an sshd listening on it is a second "node" on one
    machine, which is how multi-node launches are tested without a second machine."""
    here = {"127.0.0.1", "::1"} | _addresses("localhost") | _addresses(socket.gethostname())
    found = _addresses(address_of(host)) or {host.lower()}
    return frozenset("this machine" if a in here else a for a in found)


def _addresses(name: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(name, None)}
    except (OSError, UnicodeError):  # unknown name (socket.gaierror), or one IDNA cannot encode
        return set()


def _refuse_one_machine_twice(entries: list[tuple[int, str, int]], path: str) -> None:
    """DeepSpeed would start both lines' ranks on that one machine, each set on the same local GPUs."""
    seen: list[tuple[int, str, frozenset[str]]] = []
    for number, host, _ in entries:
        machine = machine_of(host)
        for first_number, first_host, first_machine in seen:
            common = machine & first_machine
            if common:
                reached = "this machine" if "this machine" in common else min(common)
                raise HostfileError(
                    f"{path}:{number}: {host} and {path}:{first_number}: {first_host} are one machine (both reach "
                    f"{reached}): DeepSpeed would start both lines' ranks there, on the same GPUs. Keep one line "
                    f"for it, with all its slots"
                )
        seen.append((number, host, machine))


def filter_hosts(pool: dict[str, int], include: str = "", exclude: str = "") -> dict[str, list[int]]:
    """Apply DeepSpeed's `host1:0,1@host2` filter syntax; hostfile order (and so rank order) is kept.

    A host without `:slots` means all of its slots. Returns {host: [slot ids]} without empty hosts.
    """
    if include and exclude:
        raise HostfileError("--include and --exclude are mutually exclusive: use one of them")
    active = {host: list(range(slots)) for host, slots in pool.items()}
    if not include and not exclude:
        return active
    spec = _parse_filter(include or exclude, pool, "--include" if include else "--exclude")
    if include:
        chosen = {host: (slots or active[host]) for host, slots in spec.items()}
    else:
        chosen = {}
        for host, ids in active.items():
            dropped = spec.get(host)
            chosen[host] = ids if dropped is None else [i for i in ids if dropped and i not in dropped]
    result = {host: sorted(chosen[host]) for host in pool if chosen.get(host)}
    if not result:
        raise HostfileError(f"--exclude {exclude!r} leaves no hosts to run on")
    return result


def _parse_filter(text: str, pool: dict[str, int], flag: str) -> dict[str, list[int]]:
    """`h1:0,1@h2` -> {"h1": [0, 1], "h2": []} (empty = the whole host), checked against the pool."""
    spec: dict[str, list[int]] = {}
    for part in text.split("@"):
        host, _, slot_text = part.partition(":")
        if host not in pool:
            raise HostfileError(f"{flag}: host {host!r} is not in the hostfile (hosts: {', '.join(pool)})")
        slots: list[int] = []
        for item in filter(None, slot_text.split(",")):
            if not item.isdigit() or int(item) >= pool[host]:
                raise HostfileError(f"{flag}: {host} has slots 0..{pool[host] - 1}, got {item!r}")
            slots.append(int(item))
        spec[host] = sorted(set(spec.get(host, []) + slots))
    return spec


def format_hostfile(active: dict[str, list[int]]) -> str:
    """Hostfile text for whole hosts ({host: slot ids} -> `host slots=len`)."""
    return "".join(f"{host} slots={len(slots)}\n" for host, slots in active.items())


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list: `node[01-03,07]` -> node01 node02 node03 node07; `a1,b[2-3]` -> a1 b2 b3."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_item(item, nodelist))
    if not hosts:
        raise HostfileError(f"SLURM_JOB_NODELIST={nodelist!r} names no hosts")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    return [item for item in items if item]


def _expand_item(item: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        if "[" in item or "]" in item:
            raise HostfileError(f"SLURM_JOB_NODELIST={whole!r}: unbalanced brackets in {item!r}")
        return [item]
    prefix, suffix = item[: match.start()], item[match.end() :]
    names = []
    for part in match[1].split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise HostfileError(f"SLURM_JOB_NODELIST={whole!r}: bad range {part!r} in {item!r}")
        for number in range(int(low), int(high or low) + 1):
            names.extend(_expand_item(f"{prefix}{number:0{len(low)}d}{suffix}", whole))
    return names


def slurm_hosts(environ: dict[str, str]) -> dict[str, int]:
    """{host: slots} of the current Slurm allocation: hosts from SLURM_JOB_NODELIST, slots per node from
    SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE (`4` or `h100:4`), else SLURM_NTASKS_PER_NODE."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise HostfileError(
            "--launcher slurm needs SLURM_JOB_NODELIST: run inside `sbatch` or `salloc` (see launch/slurm.sbatch)"
        )
    slots = None
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        value = environ.get(name, "").strip()
        if value:
            count = value.split(",")[0].split("(")[0].split(":")[-1]
            if not count.isdigit() or int(count) <= 0:
                raise HostfileError(f"{name}={value!r}: expected a positive count of slots per node")
            slots = int(count)
            break
    if slots is None:
        raise HostfileError(
            "--launcher slurm cannot tell the slots per node: request `--gpus-per-node=N` (GPU) or "
            "`--ntasks-per-node=N` (CPU) in the batch script"
        )
    return {host: slots for host in expand_nodelist(nodelist)}


def address_of(host: str) -> str:
    """The address ssh connects to for `host`, from the ssh config by `ssh -G` (no traffic); localhost -> 127.0.0.1.

    Falls back to the name itself without an ssh client.
    """
    try:
        out = subprocess.run(
            ["ssh", "-G", host], capture_output=True, text=True, timeout=5, stdin=subprocess.DEVNULL
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    address = next((line.split()[1] for line in out.splitlines() if line.startswith("hostname ")), host)
    return "127.0.0.1" if address == "localhost" else address


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"
