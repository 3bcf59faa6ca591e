"""Hosts made of Linux network namespaces, for tests across machines on one
machine: each host its own namespace with its own address on a bridge (the
bridge in a namespace of its own, so nothing outside the test changes),
loopback up, its own host name (``unshare -u`` per command) and, as on
Debian and Ubuntu, its own name mapped to 127.0.1.1 in its /etc/hosts
(``ip netns exec`` shows each namespace /etc/netns/NS/hosts as /etc/hosts).

Commands reach a host through an rsh agent, ``AGENT HOST COMMAND...``, which
runs the command in the host's namespace: Open MPI's ``plm_rsh_agent`` and,
as a stand-in ``ssh`` first on the PATH, ``mlx.launch``'s remote start. The
addresses are RFC 2544's benchmarking range, seen only inside the test's
namespaces.
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from conftest import ROOT, mpirun_env


SUBNET = "198.18.0"
NETWORK = f"{SUBNET}.0/24"
VENV_BIN = str(Path(sys.executable).parent)


def cannot_make() -> Optional[str]:
    """Why namespaces cannot be made here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no {tool} command"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Hosts:
    """``n`` hosts, ``host0`` ... at ``198.18.0.10`` ... on one bridge."""

    def __init__(self, n: int, workdir: Path):
        self.prefix = f"mxd{os.getpid()}"
        self.n = n
        self.names = [f"host{i}" for i in range(n)]
        self.addresses = [f"{SUBNET}.{10 + i}" for i in range(n)]
        self.namespaces = [f"{self.prefix}h{i}" for i in range(n)]
        self.switch = f"{self.prefix}sw"
        self.workdir = workdir
        self.made: List[str] = []
        try:
            self._make()
        except (subprocess.CalledProcessError, OSError) as e:
            self.close()
            detail = getattr(e, "stderr", "") or str(e)
            raise RuntimeError(f"cannot make namespace hosts: {detail.strip()}") from None
        self.agent = self._write_agent()
        self.bin = self._write_ssh()

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        self.made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("link", "add", f"{self.prefix}v{i}", "netns", self.switch, "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", self.switch, "link", "set", f"{self.prefix}v{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            others = [f"{a} {h}" for j, (a, h) in enumerate(zip(self.addresses, self.names)) if j != i]
            (etc / "hosts").write_text("\n".join(["127.0.0.1 localhost", f"127.0.1.1 {self.names[i]}", *others]) + "\n")

    def _write_agent(self) -> str:
        cases = "\n".join(f"  {h}|{a}) ns={ns} name={h} ;;" for h, a, ns in zip(self.names, self.addresses,
                                                                               self.namespaces))
        path = self.workdir / "agent"
        path.write_text(f"""#!/bin/bash
# AGENT HOST COMMAND...: COMMAND on HOST's namespace, under HOST's name.
host=$1; shift
case $host in
{cases}
  *) echo "agent: no host $host" >&2; exit 255 ;;
esac
exec ip netns exec $ns unshare -u bash -c "hostname $name; $*"
""")
        path.chmod(0o755)
        return str(path)

    def _write_ssh(self) -> str:
        """A folder holding ``ssh``: ``ssh [-tt] [-o OPTION] HOST COMMAND`` through the agent."""
        folder = self.workdir / "bin"
        folder.mkdir(exist_ok=True)
        (folder / "ssh").write_text(f"""#!/bin/bash
while [ $# -gt 0 ]; do
  case $1 in -o) shift 2 ;; -*) shift ;; *) break ;; esac
done
exec {self.agent} "$@"
""")
        (folder / "ssh").chmod(0o755)
        return str(folder)

    def close(self) -> None:
        """Every process left in the hosts ended, the namespaces deleted."""
        for ns in self.made:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self.made = []

    # -- running things on the hosts --------------------------------------------------------------------

    def env(self, extra: Optional[dict] = None) -> dict:
        """The tests' environment on the hosts, with ``extra`` over it (a value None unsets the variable)."""
        env = mpirun_env()
        env["PATH"] = os.pathsep.join([self.bin, VENV_BIN, env.get("PATH", "")])
        env.pop("OMPI_MCA_rmaps_base_oversubscribe", None)
        return {k: v for k, v in {**env, **(extra or {})}.items() if v is not None}

    def on(self, host: int, cmd: Sequence[str], timeout: float = 60, env: Optional[dict] = None,
           **kw) -> subprocess.CompletedProcess:
        """``cmd`` run on host ``host``."""
        return subprocess.run([self.agent, self.names[host], shlex.join(map(str, cmd))], capture_output=True,
                              text=True, timeout=timeout, env=self.env(env), cwd=ROOT, **kw)

    def start(self, host: int, cmd: Sequence[str], env: Optional[dict] = None) -> subprocess.Popen:
        """``cmd`` started on host ``host`` in a session of its own."""
        return subprocess.Popen([self.agent, self.names[host], shlex.join(map(str, cmd))], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=self.env(env), cwd=ROOT,
                                start_new_session=True)

    def hostfile(self, order: Sequence[int]) -> str:
        """An Open MPI hostfile of the hosts ``order`` names, one slot each."""
        path = self.workdir / f"hosts-{'-'.join(map(str, order))}.txt"
        path.write_text("".join(f"{self.names[i]} slots=1\n" for i in order))
        return str(path)

    def json_hostfile(self, order: Sequence[int], backend: str = "ring", **per_host) -> str:
        """``mlx.distributed_config``'s JSON object for the hosts ``order`` names
        (``per_host``: more keys, one value per host in that order)."""
        hosts = [{"ssh": self.names[i], "ips": [self.addresses[i]], "rdma": [],
                  **{k: v[n] for k, v in per_host.items()}} for n, i in enumerate(order)]
        path = self.workdir / f"hosts-{'-'.join(map(str, order))}.json"
        path.write_text(json.dumps({"backend": backend, "envs": [], "hosts": hosts}))
        return str(path)

    def mpirun_command(self, order: Sequence[int], cmd: Sequence[str], mpirun_args: Sequence[str] = ()) -> List[str]:
        return ["mpirun", *mpirun_args, "-np", str(len(order)), "--hostfile", self.hostfile(order),
                "--mca", "plm_rsh_agent", self.agent, "--mca", "oob_tcp_if_include", NETWORK,
                "--mca", "btl_tcp_if_include", NETWORK, "--mca", "btl", "tcp,self", "-x", "PATH",
                "--bind-to", "none", "--stdin", "none", *map(str, cmd)]

    def mpirun(self, order: Sequence[int], args: Sequence, module: Optional[str] = "mlxdist.run",
               env: Optional[dict] = None, timeout: float = 120, mpirun_args: Sequence[str] = ()):
        """``python -m module args`` (a script where module is None), one rank
        on each host of ``order`` in that order, mpirun on the first."""
        cmd = [sys.executable, *(["-m", module] if module else []), *args]
        return self.on(order[0], self.mpirun_command(order, cmd, mpirun_args), timeout=timeout, env=env)

    def mlx_launch(self, order: Sequence[int], args: Sequence, module: Optional[str] = "mlxdist.run",
                   env: Optional[dict] = None, timeout: float = 120, backend: str = "ring", script=None):
        """``mlx.launch --hostfile`` (a JSON object hostfile) over the hosts of
        ``order`` (``python -m module args``, or ``python script args``); its
        ssh is the agent."""
        what = ["-m", module] if script is None else ([str(script)] if script else [])
        cmd = [str(Path(VENV_BIN) / "mlx.launch"), "--backend", backend, "--hostfile",
               self.json_hostfile(order, backend), "--", sys.executable, *what, *map(str, args)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env(env), cwd=ROOT)

    def stop(self, proc: subprocess.Popen, hosts: Sequence[int] = (), grace: float = 20) -> None:
        """Ctrl-C to a job ``start`` began; after ``grace`` seconds, SIGKILL to
        it and to every process on ``hosts``."""
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for i in hosts:  # ranks and daemons the agent started there
            for pid in subprocess.run(["ip", "netns", "pids", self.namespaces[i]], capture_output=True,
                                      text=True).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def link(self, host: int, up: bool) -> None:
        """Host ``host``'s cable to the bridge plugged in or pulled out; plugged
        in, it returns once that host reaches every other one (a launch made
        at once failed "No route to host" while the link was still coming up)."""
        _ip("-n", self.switch, "link", "set", f"{self.prefix}v{host}", "up" if up else "down")
        if up:
            others = [a for i, a in enumerate(self.addresses) if i != host]
            reach = ("import socket, sys, time\n"
                     "for address in sys.argv[1:]:\n"
                     "    for _ in range(100):\n"
                     "        try:\n"
                     "            socket.create_connection((address, 9), timeout=1).close(); break\n"
                     "        except ConnectionRefusedError: break  # a host that answers\n"
                     "        except OSError: time.sleep(0.1)\n"
                     "    else: sys.exit(f'{address} unreachable')\n")
            subprocess.run(["ip", "netns", "exec", self.namespaces[host], sys.executable, "-c", reach, *others],
                           check=True, timeout=60)
