"""Idle ranks at rest (under real mpirun, np = 2): the worker rank of the CLI
waiting for a prompt on stdin and of an idle server uses at most 5 % of a
core, measured from its own CPU ticks; and the work still runs once asked."""

import os
import subprocess
import sys
import tempfile
import time

from conftest import MPIRUN, ROOT, mpirun_env
from test_serve import PROMPTS, Server

IDLE_SHARE = 0.05  # of one core
WINDOW = 2.0  # seconds measured


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ranks_of(proc, marker: str):
    out = subprocess.run(["ps", "-o", "pid=,args=", "-g", str(os.getpgid(proc.pid))], capture_output=True,
                         text=True).stdout
    return sorted(int(l.split()[0]) for l in out.splitlines() if marker in l and "prterun" not in l
                  and "mpirun" not in l)


def idle_share(pid: int) -> float:
    before, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(WINDOW)
    return (cpu_seconds(pid) - before) / (time.monotonic() - t0)


def test_the_cli_waiting_for_a_prompt_is_at_rest(checkpoint):
    with tempfile.TemporaryDirectory() as tmp:
        fifo = os.path.join(tmp, "stdin")
        os.mkfifo(fifo)
        env = {**mpirun_env(), "MLXDIST_STDIN": fifo}
        cmd = [MPIRUN, "-np", "2", "--oversubscribe", "--bind-to", "none", "--stdin", "none", "-x", "MLXDIST_STDIN",
               sys.executable, "-m", "mlxdist.run", "--model", str(checkpoint("qwen3_moe")), "-m", "4", "--json"]
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            with open(fifo, "w") as feed:  # opens once rank 0 reads: the model is loaded by then
                feed.write(PROMPTS[0] + "\n")
                feed.flush()
                first = proc.stdout.readline()  # the first prompt is answered...
                time.sleep(1)  # ...and both ranks settle into waiting for the next
                worker = ranks_of(proc, "mlxdist.run")[1]
                share = idle_share(worker)
                print(f"the CLI's waiting worker rank: {share:.1%} of a core")  # the results page's figure (-s)
                t0 = time.monotonic()
                feed.write(PROMPTS[1] + "\n/exit\n")
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-2000:]
            assert (first + out).count('"tokens"') == 2
            assert share <= IDLE_SHARE, f"the waiting worker rank used {share:.1%} of a core"
            assert time.monotonic() - t0 < 60
        finally:
            if proc.poll() is None:
                os.killpg(os.getpgid(proc.pid), 9)
                proc.wait()


def test_an_idle_server_is_at_rest(checkpoint):
    s = Server(checkpoint("qwen3_moe"))
    try:
        status, body = s.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4})
        assert status == 200, body
        time.sleep(1)
        worker = s.ranks()[1]
        share = idle_share(worker)
        print(f"the idle server's worker rank: {share:.1%} of a core")  # the results page's figure (-s)
        assert share <= IDLE_SHARE, f"the idle server's worker rank used {share:.1%} of a core"
        status, body = s.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4})
        assert status == 200 and body["choices"][0]["text"], body
    finally:
        assert s.stop() == 0
