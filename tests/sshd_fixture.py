"""One machine playing several nodes over loopback: a private sshd on 127.0.0.1 and 127.0.0.2, and an `ssh` wrapper
first on PATH whose config gives each host its loopback address and the sshd's port; optionally all of it inside a
private network namespace that has nothing but loopback.

    with IsolatedNetwork() as net, LoopbackCluster(tmp_path, prefix=net.prefix) as cluster:
        subprocess.run(net.prefix + [...], env=cluster.env())    # pdsh, mpirun and the launcher use the wrapper

Why the namespace: torch's TCPStore formats socket addresses with getnameinfo(), which asks the DNS server for
1.0.0.127.in-addr.arpa (the v4-mapped address is not in /etc/hosts), so every multi-process run sends packets off
loopback. Inside the namespace that lookup fails at once and nothing leaves. It needs root (`unshare`, `nsenter`,
`ip`); without them `prefix` is empty and runs happen in the normal namespace.

The hosts are named by their addresses, not by aliases like node1: mpirun looks every hostfile name up with
getaddrinfo, and a name missing from /etc/hosts becomes a DNS query to the nameserver, off loopback. Aliases are
fine where only ssh reads them (`write_ssh_wrapper`). Fresh host and user keys live in the temporary folder; ~/.ssh
is never touched (the wrapper passes `-F`). `missing_binaries()` says what a test must skip for.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

from finetune.dist import free_port

NODES = {"127.0.0.1": "127.0.0.1", "127.0.0.2": "127.0.0.2"}
BINARIES = ("/usr/sbin/sshd", "ssh", "ssh-keygen", "pdsh", "mpirun")


def missing_binaries(names: tuple[str, ...] = BINARIES) -> list[str]:
    return [name for name in names if shutil.which(name) is None]


def write_ssh_wrapper(root: str, aliases: dict[str, tuple[str, int]], key: str | None = None) -> str:
    """Write `root/bin/ssh`, the real ssh reading `root/ssh_config`, which maps each alias to (loopback address, port).

    Returns the bin folder to put first on PATH.
    """
    lines = []
    for alias, (address, port) in aliases.items():
        assert address.startswith("127."), f"loopback only, got {address}"
        lines += [f"Host {alias}", f"  HostName {address}", f"  Port {port}"]
    lines += [
        "Host *", "  User root" if os.geteuid() == 0 else f"  User {os.environ.get('USER', 'root')}",
        "  UserKnownHostsFile /dev/null", "  StrictHostKeyChecking no", "  LogLevel ERROR", "  BatchMode yes",
        "  IdentitiesOnly yes", f"  IdentityFile {key or os.path.join(root, 'no_key')}",
    ]
    config = os.path.join(root, "ssh_config")
    with open(config, "w") as f:
        f.write("\n".join(lines) + "\n")
    bin_dir = os.path.join(root, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    wrapper = os.path.join(bin_dir, "ssh")
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {config} "$@"\n')
    os.chmod(wrapper, 0o755)
    return bin_dir


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


class IsolatedNetwork:
    """A network namespace with only a loopback interface, held open by a sleeping process; a context manager.

    `prefix` (e.g. `["nsenter", "--net=/proc/123/ns/net"]`) runs a command inside it; empty when not permitted.
    """

    def __init__(self) -> None:
        self.prefix: list[str] = []
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> IsolatedNetwork:
        if missing_binaries(("unshare", "nsenter", "ip")):
            return self
        self.proc = subprocess.Popen(
            ["unshare", "--net", "sh", "-c", "ip link set lo up && echo ready && exec sleep 86400"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        prefix = ["nsenter", f"--net=/proc/{self.proc.pid}/ns/net"]
        if self.proc.stdout.readline().strip() == "ready" and subprocess.run([*prefix, "true"]).returncode == 0:
            self.prefix = prefix
        else:
            self.__exit__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class LoopbackCluster:
    """A private sshd serving `nodes` (name -> loopback address) on one free port; a context manager.

    `prefix` runs sshd inside an `IsolatedNetwork`.
    """

    def __init__(self, root: str, nodes: dict[str, str] = NODES, prefix: list[str] | None = None):
        self.root, self.nodes, self.prefix = str(root), dict(nodes), list(prefix or [])
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.bin_dir = ""

    def __enter__(self) -> LoopbackCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation folder
        host_key, user_key = (os.path.join(self.root, name) for name in ("host_key", "user_key"))
        for key in (host_key, user_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
        shutil.copy(user_key + ".pub", os.path.join(self.root, "authorized_keys"))
        config = os.path.join(self.root, "sshd_config")
        with open(config, "w") as f:
            f.write(f"Port {self.port}\n")
            f.writelines(f"ListenAddress {address}\n" for address in sorted(set(self.nodes.values())))
            f.write(
                f"HostKey {host_key}\nAuthorizedKeysFile {self.root}/authorized_keys\nPidFile {self.root}/sshd.pid\n"
                "UsePAM no\nStrictModes no\nPasswordAuthentication no\nPermitRootLogin prohibit-password\n"
                "MaxStartups 100:30:200\nMaxSessions 100\n"
            )
        log = os.path.join(self.root, "sshd.log")
        with open(log, "w") as out:
            sshd = [shutil.which("sshd") or "/usr/sbin/sshd", "-D", "-e", "-f", config]
            self.proc = subprocess.Popen(self.prefix + sshd, stdout=out, stderr=subprocess.STDOUT)
        self.bin_dir = write_ssh_wrapper(self.root, {a: (ip, self.port) for a, ip in self.nodes.items()}, user_key)
        deadline = time.monotonic() + 10
        for address in set(self.nodes.values()):
            while f"Server listening on {address} port {self.port}" not in _read(log):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"sshd did not listen on {address}:{self.port}; see {log}")
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default os.environ) with the ssh wrapper first on PATH and loopback-only gloo."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = self.bin_dir + os.pathsep + env.get("PATH", "")
        env["GLOO_SOCKET_IFNAME"] = "lo"
        return env
