"""A lost rank noticed in seconds (runtime/heartbeat.py), under real mpirun:
a rank stopped with SIGSTOP (a Mac asleep) during a generation of
``mlxdist.run`` and while ``mlxdist.serve`` answers a request ends the job
within the heartbeat plus 5 s, with one line naming the rank and its host;
under the Python API the script gets ``RankLost`` within the heartbeat,
may handle it, and the job ends with it; a rank whose main thread is busy
for longer than the heartbeat is not lost; hostile ``--heartbeat`` values
are one line."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import MPIRUN, ROOT, error_lines, kill_session, launch, mpirun_env
from test_serve import PROMPTS, Server, rank_pids_with

HEARTBEAT = 3.0
LOST_RANK_1 = f"mlxdist: error: rank 1 (host {socket.gethostname()}) sent no heartbeat for {HEARTBEAT:.1f} s: lost"


def rank_pids(session: int, module: str) -> list:
    """The ranks' pids, in rank order, of the job whose launcher leads ``session``."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "-s", str(session)], capture_output=True, text=True).stdout
    pids = [int(l.split()[0]) for l in out.splitlines()
            if f"-m {module}" in l and "prterun" not in l and "mpirun" not in l]
    ranks = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            ranks[int(env[b"OMPI_COMM_WORLD_RANK"])] = pid
        except (OSError, KeyError):
            pass
    return [ranks[r] for r in sorted(ranks)]


def launch_fifo(tmp_path) -> tuple:
    """A FIFO standing in for launch/mpirun's (``MLXDIST_LAUNCH_ENDED``),
    open for reading without waiting, so that a rank's write is taken: its
    path and the reading end."""
    path = tmp_path / "ended"
    os.mkfifo(path)
    return str(path), os.open(path, os.O_RDONLY | os.O_NONBLOCK)


def told_the_launch(fd: int) -> list:
    """The lines the ranks wrote to ``launch_fifo``'s FIFO (its reading end closed)."""
    try:
        data = os.read(fd, 65536)
    except BlockingIOError:  # a writer still holds it open, having written nothing
        data = b""
    os.close(fd)
    return data.decode().splitlines()


def test_a_stopped_rank_ends_a_generation_within_the_heartbeat(checkpoint, tmp_path):
    """SIGSTOP of rank 1 of 3 while ``run`` generates 4,000 tokens: the job
    ends non-zero within --heartbeat + 5 s (the watchdog would wait
    --timeout, 120 s), with the one line naming rank 1 and its host from
    each surviving rank (rank 0 hears it, rank 2 is told) and nothing from
    rank 1 when the launcher continues it to stop it; each surviving rank
    writes the line to launch/mpirun's FIFO as it ends."""
    fifo, told = launch_fifo(tmp_path)
    cmd = [MPIRUN, "-np", "3", "--oversubscribe", "--bind-to", "none", "--stdin", "none", sys.executable, "-m",
           "mlxdist.run", "--model", str(checkpoint("qwen3_moe")), "-p", "Hello", "-m", "4000",
           "--heartbeat", str(HEARTBEAT)]
    proc = subprocess.Popen(cmd, env={**mpirun_env(), "MLXDIST_LAUNCH_ENDED": fifo}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        first = proc.stdout.read1(64)  # the first generated text: rank 1 is generating
        assert first, proc.stderr.read().decode()[-3000:]
        ranks = rank_pids(proc.pid, "mlxdist.run")
        assert len(ranks) == 3
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # a full pipe must not stall rank 0
        proc.wait(60)
        ended = time.monotonic() - stopped
        stderr = proc.stderr.read().decode()
        assert proc.returncode != 0
        assert error_lines(stderr) == [LOST_RANK_1] * 2, stderr[-3000:]
        assert ended < HEARTBEAT + 5, (ended, stderr[-3000:])
        assert told_the_launch(told) == [LOST_RANK_1.removeprefix("mlxdist: error: ")] * 2
    finally:
        if proc.poll() is None:
            kill_session(proc.pid)
            proc.wait()


API_SCRIPT = """
import sys, time
import mlxdist

with mlxdist.init(heartbeat=float(sys.argv[2])) as cluster:
    cluster.load(sys.argv[1], mode="collective")
    print("loaded", flush=True)
    try:
        cluster.generate("Hello", max_tokens=4000)
        print("finished", flush=True)
    except mlxdist.RankLost as e:
        print("caught", time.monotonic(), e, flush=True)
        try:
            cluster.stats()
        except mlxdist.RankLost as again:
            print("again", again, flush=True)
        time.sleep(2)  # the ranks left wait for the script
        print("saved", flush=True)
"""


def test_a_stopped_rank_raises_rank_lost_in_an_api_script(checkpoint, tmp_path):
    """SIGSTOP of rank 1 of 3 while a script's ``generate`` runs: the script
    catches ``mlxdist.RankLost`` naming rank 1 and its host within
    --heartbeat + 5 s (rank 0's thread is still inside the exchange), every
    later command raises it too, the script may take its time to save what
    it has (rank 2 waits for it), and the job then ends non-zero; rank 0
    writes the line to launch/mpirun's FIFO as its process ends."""
    script = tmp_path / "job.py"
    script.write_text(API_SCRIPT)
    fifo, told = launch_fifo(tmp_path)
    cmd = [MPIRUN, "-np", "3", "--oversubscribe", "--bind-to", "none", "--stdin", "none", sys.executable,
           str(script), str(checkpoint("qwen3_moe")), str(HEARTBEAT)]
    proc = subprocess.Popen(cmd, env={**mpirun_env(), "MLXDIST_LAUNCH_ENDED": fifo}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "loaded", proc.stderr.read()[-3000:]
        time.sleep(1.5)  # inside the generation
        ranks = rank_pids_with([str(script)])
        assert len(ranks) == 3, ranks
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        out, err = proc.communicate(timeout=60)
        ended = time.monotonic() - stopped
        lines = out.splitlines()
        caught = [l for l in lines if l.startswith("caught ")]
        assert caught, (out, err[-3000:])
        _, at, message = caught[0].split(" ", 2)
        lost = LOST_RANK_1.removeprefix("mlxdist: error: ")
        assert message == lost and float(at) - stopped < HEARTBEAT + 5, (caught, stopped)
        assert f"again {lost}" in lines and lines[-1] == "saved", out
        assert proc.returncode != 0 and ended < HEARTBEAT + 5 + 2 + 5, (proc.returncode, ended)
        assert error_lines(err) == [LOST_RANK_1], err[-3000:]  # rank 2's; the script handled its own
        assert told_the_launch(told) == [lost]
    finally:
        if proc.poll() is None:
            kill_session(proc.pid)
            proc.wait()


def test_a_busy_rank_is_not_lost(checkpoint):
    """Rank 1's main thread asleep for 2.5 x the heartbeat inside a forward
    pass (MLXDIST_FAULT), rank 0 waiting on it in the exchange: both
    heartbeat threads go on beating, and the generation ends as usual."""
    proc = launch(2, ["--model", checkpoint("qwen3_moe"), "-p", "Hello", "-m", "6", "--heartbeat", str(HEARTBEAT)],
                  env={"MLXDIST_FAULT": f"sleep:rank=1,layer=0,step=2,seconds={2.5 * HEARTBEAT}"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "heartbeat" not in proc.stderr and proc.stdout.strip()


def test_a_stopped_rank_ends_the_server_within_the_heartbeat(checkpoint):
    """SIGSTOP of rank 1 while a request decodes: the request gets 503 and
    the job ends non-zero within --heartbeat + 5 s of the stop (the serving
    watchdog would wait 10 x --timeout, 20 minutes), with the one line."""
    s = Server(checkpoint("qwen3_moe"), extra=["--heartbeat", str(HEARTBEAT)])
    try:
        victim = s.ranks()[1]
        got = {}

        def ask():
            got["answer"] = s.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4000})
            got["at"] = time.monotonic()

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        deadline = time.monotonic() + 60  # the request decodes (its steps counted), then rank 1 stops
        while json.loads(s.get("/health")[1])["step_seconds"]["count"] < 10 and time.monotonic() < deadline \
                and "at" not in got:
            time.sleep(0.05)
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        asking.join(60)
        s.proc.wait(60)
        ended = time.monotonic() - stopped
        stderr = s.proc.stderr.read()
        status, body = got["answer"]
        assert status == 503 and body["error"]["code"] == 503, (
            f"answered {got['at'] - stopped:+.1f} s from the stop: {status} "
            f"{body.get('usage') if isinstance(body, dict) else body}"
            f" {body['choices'][0]['finish_reason'] if status == 200 else ''}\n{stderr[-3000:]}")
        assert got["at"] - stopped < HEARTBEAT + 5 and ended < HEARTBEAT + 5, (got["at"] - stopped, ended)
        assert s.proc.returncode != 0
        assert error_lines(stderr) == [LOST_RANK_1], stderr[-3000:]
    finally:
        if s.proc.poll() is None:
            kill_session(s.proc.pid)
            s.proc.wait()


def test_hostile_heartbeats_are_one_line(capsys):
    """Not a number, not ASCII, too short, not finite, huge: status 2 and one
    line from run's and serve's parsers; under mpirun, from rank 0 alone."""
    from mlxdist.cli.run import build_parser as run_parser
    from mlxdist.cli.serve import build_parser as serve_parser

    for parser in (run_parser(), serve_parser()):
        assert parser.parse_args(["--heartbeat", "off"]).heartbeat is None
        assert parser.parse_args(["--heartbeat", "2.5"]).heartbeat == 2.5
        for value in ["", "abc", "0.5", "-5", "nan", "inf", "1e400", "５", "x" * 10_000]:
            with pytest.raises(SystemExit) as refused:
                parser.parse_args(["--heartbeat", value])
            assert refused.value.code == 2
            errors = [l for l in capsys.readouterr().err.splitlines() if "error" in l]
            assert len(errors) == 1 and "argument --heartbeat: the value must be a number of seconds of at least 1" \
                in errors[0] and len(errors[0]) < 300, (value, errors)
    proc = launch(2, ["-p", "hi", "--heartbeat", "nan"], timeout=120)
    assert proc.returncode == 2 and len([l for l in proc.stderr.splitlines() if "error" in l]) == 1, proc.stderr


def test_init_refuses_a_hostile_heartbeat_in_one_line():
    """``init(heartbeat=)``: seconds, or None / 0 / "off" for none; anything else is one ``UserError``."""
    from mlxdist.errors import UserError
    from mlxdist.runtime.heartbeat import check_heartbeat

    assert [check_heartbeat(v) for v in (5, 2.5, "7", None, 0, "off")] == [5.0, 2.5, 7.0, None, None, None]
    for value in (True, 0.5, -1, float("nan"), float("inf"), "", "５", "1e400", [5], "x" * 10_000):
        with pytest.raises(UserError) as refused:
            check_heartbeat(value)
        assert "\n" not in str(refused.value) and len(str(refused.value)) < 200, value


def test_the_default_heartbeat_is_the_environments(monkeypatch, checkpoint):
    """Where no heartbeat is given, every command line, ``init`` and the front
    take ``MLXDIST_HEARTBEAT`` (else 5 s); a hostile value is one line, here
    and from a launch."""
    from mlxdist.cli.run import build_parser as run_parser
    from mlxdist.errors import BadVariable
    from mlxdist.front.job import JobSpec
    from mlxdist.runtime.heartbeat import check_heartbeat

    given = run_parser().parse_args([]).heartbeat
    monkeypatch.delenv("MLXDIST_HEARTBEAT", raising=False)
    assert check_heartbeat(given) == 5.0
    for text, seconds in (("12", 12.0), ("2.5", 2.5), ("off", None), ("0", None)):
        monkeypatch.setenv("MLXDIST_HEARTBEAT", text)
        assert check_heartbeat(given) == seconds, text
    monkeypatch.setenv("MLXDIST_HEARTBEAT", "12")
    settings = type("Settings", (), {"ranks": 2, "rank_argv": ["--model", "M"]})
    assert JobSpec.from_settings(settings).heartbeat == 12.0
    for text in ("0.5", "abc", "nan", "５"):
        monkeypatch.setenv("MLXDIST_HEARTBEAT", text)
        with pytest.raises(BadVariable) as refused:
            check_heartbeat(given)
        assert "MLXDIST_HEARTBEAT" in str(refused.value) and "\n" not in str(refused.value), text
    proc = launch(2, ["--model", str(checkpoint("qwen3_moe")), "-p", "hi", "-m", "2"], timeout=120,
                  env={"MLXDIST_HEARTBEAT": "0.5"})
    errors = [l for l in proc.stderr.splitlines() if "error" in l]
    assert proc.returncode != 0 and len(errors) == 1 and "MLXDIST_HEARTBEAT" in errors[0], proc.stderr[-2000:]


def test_link_reports_on_the_heartbeat_are_read_and_hostile_ones_ignored():
    """Rank 0 keeps a rank's newest whole ``L <sent> <received> <interface>``
    line, split over reads or mixed with plain beats; anything else (letters,
    huge numbers, long or odd names, an endless line) is a beat and nothing
    more, and what it keeps of a line stays bounded."""
    from mlxdist.runtime.heartbeat import MAX_REPORT, Peer, _take_report

    peer = Peer(1, "h", None, 0.0)
    for data in (b"..L 10 2", b"0 lo\n", b"."):
        _take_report(peer, data)
    assert peer.link == (10, 20, "lo")
    _take_report(peer, b"L 11 21 en0\nL 12 22 en0\n")
    assert peer.link == (12, 22, "en0")
    for hostile in (b"L x 1 lo\n", b"L 1 2\n", b"L 1 2 lo extra\n", b"L " + b"9" * 30 + b" 1 lo\n",
                    b"L 1 2 " + b"n" * 40 + b"\n", b"L 1 2 \xff\xfe\n", b"L -1 2 lo\n", b"\n\n\n", b"L 1 2 l\x07o\n"):
        _take_report(peer, hostile)
        assert peer.link == (12, 22, "en0"), hostile
    _take_report(peer, b"L" * 1_000_000)
    assert len(peer.partial) <= MAX_REPORT and peer.link == (12, 22, "en0")


def test_the_fronts_metrics_skip_malformed_rank_counters():
    """The rank server's counters reach /metrics only where well formed."""
    from prometheus_client.parser import text_string_to_metric_families

    from mlxdist.front.metrics import FrontMetrics

    class Job:
        state, ranks = "ok", 2

    metrics = FrontMetrics(Job())
    good_steps = {"buckets": [0.1, 1.0], "counts": [3, 5], "sum": 2.5, "count": 6}
    for health in (None, [], {"step_seconds": "x", "link_bytes": {"a": 1}, "exchange_bytes": [1]},
                   {"step_seconds": {**good_steps, "counts": [3]}, "link_bytes": [{"rank": -1}, 5, None]},
                   {"exchange_bytes": {"sent": True, "received": 1}, "step_seconds": {**good_steps, "sum": "1"}}):
        metrics.rank_health = health
        names = {f.name for f in text_string_to_metric_families(metrics.text().decode())}
        assert not names & {"mlxdist_step_seconds", "mlxdist_rank0_exchange_bytes"}, (health, names)
    metrics.rank_health = {"step_seconds": good_steps, "exchange_bytes": {"sent": 1, "received": 2},
                           "link_bytes": [{"rank": 1, "host": "mac-2", "interface": "bridge0", "sent": 7,
                                           "received": 8}]}
    samples = {s.name + str(sorted(s.labels.items())): s.value
               for f in text_string_to_metric_families(metrics.text().decode()) for s in f.samples}
    assert samples["mlxdist_step_seconds_bucket[('le', '1.0')]"] == 5
    assert samples["mlxdist_step_seconds_bucket[('le', '+Inf')]"] == 6
    assert samples["mlxdist_link_bytes_total[('direction', 'received'), ('host', 'mac-2'), "
                   "('interface', 'bridge0'), ('rank', '1')]"] == 8


def test_clear_cache_waits_without_the_gil():
    """mlx-lm calls mx.clear_cache() with the next token's work (and its
    exchange) in flight; MLX's waits for that work holding the GIL, so a
    rank lost then left the heartbeat thread unable to run (the job never
    ended). As ranks start it (runtime/gil.py) it waits without: another
    thread runs meanwhile. Failed before: 1 tick of that thread in 2.7 s."""
    import threading

    import mlx.core as mx

    from mlxdist.runtime.gil import hold_no_lock_while_waiting

    original = mx.clear_cache
    hold_no_lock_while_waiting()
    ticks, stop = [0], threading.Event()

    def tick():
        while not stop.wait(0.01):
            ticks[0] += 1

    try:
        threading.Thread(target=tick, daemon=True).start()
        a = mx.random.normal((800, 800))
        mx.eval(a)
        work = a
        for _ in range(15):
            work = work @ a / 800
        mx.async_eval(work)
        before, started = ticks[0], time.monotonic()
        mx.clear_cache()
        waited = time.monotonic() - started
        assert waited > 0.3, f"the work was done before clear_cache was called ({waited:.2f} s): make it longer"
        assert ticks[0] - before >= 5, (ticks[0] - before, waited)
    finally:
        stop.set()
        mx.clear_cache = original
