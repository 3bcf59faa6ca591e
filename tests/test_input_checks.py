"""Options, environment variables and API keys checked at start: a value
that cannot mean what it says is one line and a non-zero exit (or a 400),
never noise, a traceback or a hang (mlxdist/inputs/digits.py, envs.py,
cli/api_key.py). Numbers are read in ASCII digits only, by one parser:
Python's int() and float() take any Unicode digit (int("١") is 1)."""

import os
import re
import threading
import pytest

from conftest import ROOT, launch
from mlxdist.errors import BadVariable, UserError

ARABIC_ONE, WIDE_TWO, WIDE_FIVE = "\u0661", "\uff12", "\uff15"


def refused(parser, argv) -> None:
    """``parser`` (build_parser()) refuses ``argv`` as argparse does: status 2."""
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2, argv


def one_line(proc) -> str:
    """The one error line of a refused start: non-zero, no traceback."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [l for l in (x.lstrip("\0") for x in proc.stderr.splitlines()) if "error:" in l]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


# -- item 10: options not checked at start ------------------------------------------------------

def test_serve_and_run_refuse_sampling_defaults_no_request_could_use(capsys):
    """serve --temp nan|inf|-1 and --top-p nan|2 started on today's main, every
    default request then noise or a 400; run --memory-budget inf a ValueError."""
    from mlxdist.cli.run import build_parser as run_parser
    from mlxdist.cli.serve import build_parser as serve_parser
    from mlxdist.config import GenerationParams

    for argv in (["--temp", "nan"], ["--temp", "inf"], ["--temp", "-1"], ["--temp", "101"], ["--top-p", "nan"],
                 ["--top-p", "2"], ["--top-p", "-0.1"]):
        refused(serve_parser(), argv)
    assert "a number from 0 to 100" in capsys.readouterr().err
    args = serve_parser().parse_args(["--temp", "0.7", "--top-p", "0"])
    assert (args.temp, args.top_p) == (0.7, 0.0)  # what a request may ask (serving/schema.py): 0 is off
    for argv in (["--memory-budget", "inf"], ["--memory-budget", "nan"], ["--memory-budget", "0"],
                 ["--temp", "inf"], ["--top-p", "nan"], ["--min-p", "nan"], ["--temp", "1e400"]):
        refused(run_parser(), argv)
    assert run_parser().parse_args(["--memory-budget", "1e-1"]).memory_budget == 0.1
    args = run_parser().parse_args(["--temp", "-0.5", "--top-p", "2"])  # in range or not: GenerationParams says
    with pytest.raises(UserError, match="temperature must be >= 0"):
        GenerationParams(temp=args.temp).validate()
    with pytest.raises(UserError, match="temperature must be finite"):
        GenerationParams(temp=float("inf")).validate()  # the API's and job files' path


def test_doctor_refuses_a_min_disk_that_checks_nothing():
    """--min-disk nan turned the disk check off on today's main."""
    from mlxdist.doctor.__main__ import main

    for value in ("nan", "-1", "inf", WIDE_FIVE):
        with pytest.raises(SystemExit) as e:
            main(["--min-disk", value])
        assert e.value.code == 2


def test_supervise_refuses_impossible_ranks_and_a_missing_mpirun(tmp_path, capsys):
    """--ranks 0|-1 and --min-ranks above --ranks were taken; --mpirun
    /nonexistent was a traceback."""
    from mlxdist.cli.supervise import main

    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"id": 1, "prompt": "hi"}\n')
    after = ["--", "--jobs", str(jobs), "--out", str(tmp_path / "out.jsonl")]
    for own in (["--ranks", "0"], ["--ranks", "-1"], ["--ranks", "2", "--min-ranks", "3"],
                ["--ranks", "2", "--min-ranks", "0"]):
        with pytest.raises(SystemExit) as e:
            main(own + after)
        assert e.value.code == 2, own
    capsys.readouterr()
    assert main(["--ranks", "2", "--mpirun", str(tmp_path / "nonexistent")] + after) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--mpirun" in err and "no such program" in err, err


@pytest.mark.parametrize("name,value,words", [
    ("MLXDIST_GROUPED_EXPERTS", "yes", "must be 0 or 1"),
    ("MLXDIST_GROUPED_EXPERTS", "2", "must be 0 or 1"),
    ("MLXDIST_TEST_MEMORY_GB", "abc", "positive number of GB"),
    ("MLXDIST_TEST_MEMORY_GB", "16,nan", "positive number of GB"),
    ("MLXDIST_CONNECT_TIMEOUT", "99999999999999999999", "from 1 to 31536000"),
    ("MLXDIST_CONNECT_TIMEOUT", "0", "from 1 to 31536000"),
])
def test_environment_values_are_checked_as_read(monkeypatch, name, value, words):
    """Today's main took any MLXDIST_GROUPED_EXPERTS, raised a raw ValueError
    for MLXDIST_TEST_MEMORY_GB=abc at load, and killed a rank at once with a
    false "did not connect" for a timeout past a shell's integers."""
    from mlxdist import envs

    monkeypatch.setenv(name, value)
    with pytest.raises(BadVariable, match=f"{name}=.*{re.escape(words)}"):
        envs.check()


def test_environment_values_read_as_documented(monkeypatch):
    from mlxdist import envs
    from mlxdist.runtime.memory import detect_memory

    monkeypatch.setenv("MLXDIST_TEST_MEMORY_GB", "16, 8")
    assert [detect_memory(r)[0] for r in (0, 1, 2)] == [16 * 10**9, 8 * 10**9, 8 * 10**9]
    monkeypatch.setenv("MLXDIST_GROUPED_EXPERTS", " 1")
    monkeypatch.setenv("MLXDIST_CONNECT_TIMEOUT", "31536000")
    assert (envs.get("MLXDIST_GROUPED_EXPERTS"), envs.get("MLXDIST_CONNECT_TIMEOUT")) == ("1", 31536000)


def test_a_huge_connect_timeout_is_one_line_on_every_rank():
    """Under mpirun with the ring backend, today's main killed the ranks at
    once saying they "did not connect"."""
    proc = launch(2, ["-p", "hi", "-m", "1", "--backend", "ring"], timeout=120,
                  env={"MLXDIST_CONNECT_TIMEOUT": "99999999999999999999"})
    line = one_line(proc)
    assert "MLXDIST_CONNECT_TIMEOUT" in line and "did not connect" not in proc.stderr, proc.stderr[-2000:]


JOIN = "from mlxdist.runtime.world import join; print('rank', join().rank, flush=True)"


def test_mlx_mpi_libname_empty_is_unset_and_a_wrong_one_is_named(tmp_path):
    """An empty MLX_MPI_LIBNAME gave only "Cannot initialize MPI" on today's main."""
    script = tmp_path / "join.py"
    script.write_text(JOIN)
    proc = launch(2, [script], module=None, env={"MLX_MPI_LIBNAME": ""}, timeout=120)
    assert proc.returncode == 0 and sorted(proc.stdout.split("\n"))[-2:] == ["rank 0", "rank 1"], proc.stderr[-2000:]
    proc = launch(2, [script], module=None, env={"MLX_MPI_LIBNAME": str(tmp_path / "libnothing.so")}, timeout=120)
    assert "MLX_MPI_LIBNAME=" + str(tmp_path / "libnothing.so") in one_line(proc)


def test_n_must_be_the_integer_one():
    """"n": true (and 1.0) passed as n = 1 on today's main: true == 1 in Python."""
    from mlxdist.errors import RequestError
    from mlxdist.serving.schema import RequestLimits, check_request

    limits = RequestLimits(vocab_size=512)
    for n in ("true", "1.0", "2", '"1"'):
        with pytest.raises(RequestError, match="n must be 1"):
            check_request(b'{"prompt": "hi", "n": %s}' % n.encode(), limits)
    assert check_request(b'{"prompt": "hi", "n": 1}', limits)[0]["n"] == 1


# -- item 11: ASCII digits everywhere ------------------------------------------------------------

def test_no_number_is_read_with_int_or_float_from_a_command_line():
    """Every number a command line takes is read by mlxdist/inputs/digits.py (argparse's
    type=int and type=float take any Unicode digit, and float() "nan")."""
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "mlxdist").rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"type=(int|float)\b", line)]
    assert not offenders, offenders


def test_numbers_in_other_digits_are_refused(tmp_path, monkeypatch, capsys):
    """Each was read as a number on today's main (cache remove --rank ١
    removed rank 1's share)."""
    from mlxdist.cache.__main__ import main as cache_main
    from mlxdist.cli.place import build_parser as place_parser
    from mlxdist.cli.run import build_parser as run_parser
    from mlxdist.cli.relaunch import read_hostfile
    from mlxdist.cli.supervise import main as supervise_main
    from mlxdist.inputs.digits import parse_number
    from mlxdist.model.budgets import parse_rank_memory
    from mlxdist.runtime import faults

    refused(run_parser(), ["--prompt-lookup-ngram", WIDE_FIVE])
    refused(run_parser(), ["--temp", "0" + WIDE_FIVE])
    refused(place_parser(), ["routing.json", "--ranks", WIDE_TWO, "-o", "p.json"])
    monkeypatch.setenv("MLXDIST_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as e:
        cache_main(["remove", "0" * 16, "--rank", ARABIC_ONE])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        supervise_main(["--ranks", WIDE_TWO, "--", "--jobs", "j", "--out", "o"])
    assert e.value.code == 2
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"localhost slots={WIDE_TWO}\n")
    with pytest.raises(UserError, match="line 1: slots must be"):
        read_hostfile(str(hostfile))
    hostfile.write_text("# two hosts\nlocalhost slots=2\nother\n")
    assert read_hostfile(str(hostfile)) == [("localhost", 2), ("other", 1)]
    monkeypatch.setenv("MLXDIST_FAULT", f"kill:rank={ARABIC_ONE},layer=0,step=0")
    with pytest.raises(BadVariable, match="MLXDIST_FAULT.*rank must be an integer in ASCII digits"):
        faults.arm(1)
    for text in (f"6{WIDE_FIVE},32", f"a=1,b={WIDE_TWO}", "1_0", "nan,1"):
        with pytest.raises(UserError):
            parse_rank_memory(text)
    assert parse_rank_memory("64, 32.5") == [64.0, 32.5]
    for text in (WIDE_FIVE, "1_0", "nan", "inf", "1e400", " 1", "0x10", "", "-" + WIDE_FIVE):
        with pytest.raises(ValueError):
            parse_number(text, "x")
    assert [parse_number(t, "x") for t in ("2", "0.5", ".5", "1e2", "-1.5")] == [2, 0.5, 0.5, 100, -1.5]


def test_load_budgets_are_numbers_not_text():
    """load(rank_memory_gb=["５"]) (or [True], {"h": "nan"}) became 5.0 (1.0, nan) through float() on
    today's main."""
    from mlxdist.api import _budgets
    from mlxdist.config import LoadOptions

    for budgets in ([WIDE_FIVE], [True], {"h": "nan"}, ["64"]):
        with pytest.raises(UserError, match="--rank-memory must give a positive number"):
            LoadOptions(model="m", rank_memory_gb=_budgets(budgets)).validate()
    assert _budgets({"h": 64}) == {"h": 64.0}


def test_a_number_in_other_digits_is_one_line_under_mpirun():
    proc = launch(2, ["-p", "hi", "--prompt-lookup-ngram", WIDE_FIVE], timeout=120)
    assert proc.returncode == 2 and "--prompt-lookup-ngram" in one_line(proc), proc.stderr[-2000:]


# -- item 12: API keys ---------------------------------------------------------------------------

def key_of(argv, monkeypatch, env=None):
    """(the key, or the reason the server refuses to start) for serve's ``argv``."""
    from mlxdist.cli.serve import build_parser, check_options

    monkeypatch.delenv("MLXDIST_API_KEY", raising=False)
    if env is not None:
        monkeypatch.setenv("MLXDIST_API_KEY", env)
    args = build_parser().parse_args(argv)
    return check_options(args) or args.api_key


def test_an_empty_or_unusable_api_key_is_refused(tmp_path, monkeypatch):
    """--api-key '' and MLXDIST_API_KEY='   ' meant no key on today's main; a
    key file was cut at 4,096 characters without a word; a BOM, NULs or
    non-ASCII were taken, and no client could then send the key."""
    assert "--api-key is empty" in key_of(["--api-key", ""], monkeypatch)
    assert "MLXDIST_API_KEY is set but empty or blank" in key_of([], monkeypatch, env="   ")
    assert "MLXDIST_API_KEY is set but empty or blank" in key_of([], monkeypatch, env="")
    assert "a control character (U+0000)" in key_of(["--api-key", "ab\0c"], monkeypatch)
    assert "not ASCII (U+00E9)" in key_of([], monkeypatch, env="caf\u00e9")
    assert "a space" in key_of(["--api-key", "two words"], monkeypatch)
    assert "at most 4096" in key_of(["--api-key", "k" * 4097], monkeypatch)
    key = tmp_path / "key"
    cases = {b"k" * 5000 + b"\n": "longer than 4096", b"k" * 5000: "longer than 4096",
             b"\xef\xbb\xbfsecret\n": "byte-order mark", b"sec\0ret\n": "a control character (U+0000)",
             "s\u00e9cret\n".encode(): "not ASCII (U+00E9)", b"s\xe9cret\n": "not text", b"  \n": "first line is empty", b"": "first line is empty"}
    for content, words in cases.items():
        key.write_bytes(content)
        assert words in key_of(["--api-key-file", str(key)], monkeypatch), content[:20]
    key.write_bytes(b"k" * 4096 + b"\r\nsecond line\n")
    assert key_of(["--api-key-file", str(key)], monkeypatch) == "k" * 4096
    assert key_of(["--api-key", "sk-" + "a/b+c=~_." * 3], monkeypatch) == "sk-" + "a/b+c=~_." * 3
    assert "not a regular file" in key_of(["--api-key-file", str(tmp_path)], monkeypatch)


def test_a_fifo_key_file_is_refused_at_once(tmp_path, monkeypatch):
    """A FIFO as --api-key-file blocked start-up forever on today's main."""
    fifo = tmp_path / "key"
    os.mkfifo(fifo)
    answer = []
    reader = threading.Thread(target=lambda: answer.append(key_of(["--api-key-file", str(fifo)], monkeypatch)),
                              daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock the reader before failing
        with open(fifo, "w"):
            pass
        pytest.fail("reading a FIFO key file blocked")
    assert "not a regular file" in answer[0]


def test_a_blank_api_key_is_one_line_under_mpirun(tmp_path):
    proc = launch(2, ["--host", "0.0.0.0"], module="mlxdist.serve", env={"MLXDIST_API_KEY": "   "}, timeout=120)
    assert proc.returncode == 2 and "MLXDIST_API_KEY is set but empty or blank" in one_line(proc), proc.stderr[-2000:]
    proc = launch(0, ["--api-key", ""], module="mlxdist.serve", timeout=120)
    assert proc.returncode == 2 and "--api-key is empty" in one_line(proc), proc.stderr[-2000:]
    proc = launch(2, ["--temp", "nan"], module="mlxdist.serve", timeout=120)
    assert proc.returncode == 2 and "--temp" in one_line(proc), proc.stderr[-2000:]
