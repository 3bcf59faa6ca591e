"""The command line follows mlx_lm.generate: the chat template by default
(with --system-prompt), --ignore-chat-template for the raw prompt, -m with
mlx-lm's default, --max-kv-size. Tokens are compared with mlx-lm alone on
the same token ids."""

import pytest

from conftest import last_json, launch

PROMPT = "The quick brown fox jumps over the lazy dog because"


def mlx_lm_tokens(path, prompt_ids, max_tokens, **kwargs):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import stream_generate

    model, tokenizer = load(str(path))
    steps = stream_generate(model, tokenizer, mx.array(prompt_ids), max_tokens=max_tokens, **kwargs)
    return [s.token for s in steps]


def templated(path, messages):
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(path)
    assert tokenizer.has_chat_template
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


@pytest.fixture(scope="module")
def by_arg(checkpoint):
    """``-p PROMPT -m 8 --json --stats``: one run that several tests read."""
    proc = launch(2, ["--model", checkpoint("qwen3_moe"), "-p", PROMPT, "-m", 8, "--json", "--stats"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return last_json(proc.stdout)


@pytest.mark.parametrize("system", [None, "You are terse."])
def test_chat_template_by_default(checkpoint, request, system):
    path = checkpoint("qwen3_moe")
    messages = [{"role": "user", "content": PROMPT}]
    if system:
        proc = launch(2, ["--model", path, "-p", PROMPT, "-m", 8, "--json", "--system-prompt", system])
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = last_json(proc.stdout)
        messages.insert(0, {"role": "system", "content": system})
    else:
        result = request.getfixturevalue("by_arg")
    ids = templated(path, messages)
    assert result["prompt_tokens"] == len(ids)
    assert result["tokens"] == mlx_lm_tokens(path, ids, 8)


def test_max_kv_size_is_a_rotating_cache(checkpoint):
    from mlx_lm.utils import load_tokenizer

    path = checkpoint("qwen3_moe")
    prompt = PROMPT + " " + PROMPT
    proc = launch(2, ["--model", path, "-p", prompt, "-m", 12, "--json", "--ignore-chat-template",
                      "--max-kv-size", 16, "--prefill-step-size", 8])
    assert proc.returncode == 0, proc.stderr[-2000:]
    ids = load_tokenizer(path).encode(prompt)
    assert len(ids) > 16
    expected = mlx_lm_tokens(path, ids, 12, max_kv_size=16, prefill_step_size=8)
    assert last_json(proc.stdout)["tokens"] == expected
    assert expected != mlx_lm_tokens(path, ids, 12, prefill_step_size=8)  # the cache really rotated


def test_defaults_follow_mlx_lm():
    from mlx_lm.generate import DEFAULT_MAX_TOKENS

    from mlxdist.cli.run import build_parser

    args = build_parser().parse_args([])
    assert args.max_tokens == DEFAULT_MAX_TOKENS
    assert build_parser().parse_args(["-p", "x", "-m", "5"]).max_tokens == 5
    assert args.mode == "auto" and args.layout is None and args.backend is None


def test_old_spellings_of_mode_still_work_for_one_release():
    """--mode is --mode's old name on every command line that takes it,
    and load(dispatch=) the keyword's: both still read for one release
    (docs/architecture.md's glossary); both at once is one line."""
    from mlxdist.api import _load_options
    from mlxdist.cli.run import build_parser
    from mlxdist.errors import UserError

    assert build_parser().parse_args(["--mode", "p2p"]).mode == "p2p"
    assert build_parser().parse_args(["--mode", "p2p"]).mode == "p2p"
    assert _load_options("m", None, {"dispatch": "p2p", "layout": "masked"}).mode == "p2p"
    assert _load_options("m", None, {"mode": "dp", "layout": "masked"}).mode == "dp"
    with pytest.raises(UserError, match="give one of them"):
        _load_options("m", None, {"mode": "dp", "dispatch": "p2p", "layout": "masked"})


def test_help_is_grouped_and_verbose_is_off_by_default():
    """run --help lists every option under a group (model, prompt, sampling,
    ...), none loose; --verbose alone or True turns the cost model on, False
    (mlx_lm.generate's) leaves the text alone, and the default is neither."""
    from mlxdist.cli.run import build_parser

    parser = build_parser()
    groups = {group.title: group for group in parser._action_groups}
    assert {"model", "prompt", "sampling", "speculative decoding", "distribution", "memory", "output",
            "job"} <= set(groups)
    loose = [a.dest for a in groups["options"]._group_actions if a.dest != "help"]
    assert loose == [], loose
    assert [a.dest for a in groups["model"]._group_actions][0] == "model"
    assert "mode" in [a.dest for a in groups["distribution"]._group_actions]
    assert parser.parse_args([]).verbose is None
    assert parser.parse_args(["--verbose"]).verbose is True
    assert parser.parse_args(["--verbose", "True"]).verbose is True
    assert parser.parse_args(["--verbose", "False"]).verbose is False


def test_stats_flag_reports_expert_load(by_arg):
    load = by_arg["expert_load"]
    assert load and all(sum(counts) > 0 for counts in load.values())


def test_logprobs_out_on_a_bf16_quantized_checkpoint(checkpoint, tmp_path):
    """--logprobs-out writes bf16 log-probabilities (exact as float32), as mlx-lm's own are."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from mlx_lm.generate import stream_generate

    path = checkpoint("qwen3_moe", bits=4, dtype="bfloat16")
    out = tmp_path / "lp.npy"
    proc = launch(2, ["--model", path, "-p", PROMPT, "-m", 6, "--ignore-chat-template", "--json",
                      "--mode", "collective", "--logprobs-out", out])
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = np.load(out)
    model, tokenizer = load(str(path))
    steps = list(stream_generate(model, tokenizer, mx.array(tokenizer.encode(PROMPT)), max_tokens=6))
    assert steps[0].logprobs.dtype == mx.bfloat16 and saved.dtype == np.float32
    assert np.array_equal(saved, np.stack([np.array(s.logprobs.astype(mx.float32)) for s in steps]))
    assert last_json(proc.stdout)["tokens"] == [s.token for s in steps]


def test_mlx_lm_habits_prompt_from_stdin_verbose_and_one_argparse_error(checkpoint, by_arg):
    """-p - reads the prompt from stdin; --verbose False prints the text alone;
    a bad option is reported once, by rank 0, whatever the number of ranks."""
    path = checkpoint("qwen3_moe")
    by_stdin = launch(2, ["--model", path, "-p", "-", "-m", 8, "--json"], input=PROMPT)
    assert by_stdin.returncode == 0, by_stdin.stderr[-2000:]
    assert last_json(by_stdin.stdout)["tokens"] == by_arg["tokens"]
    quiet = launch(2, ["--model", path, "-p", PROMPT, "-m", 6, "--verbose", "False"])
    loud = launch(2, ["--model", path, "-p", PROMPT, "-m", 6])
    assert quiet.returncode == loud.returncode == 0
    assert "generation:" in loud.stderr and "generation:" not in quiet.stderr
    assert not [line for line in loud.stderr.splitlines() if line.startswith("auto:")], loud.stderr  # --verbose's
    assert quiet.stdout == loud.stdout
    bad = launch(2, ["--model", path, "-p", PROMPT, "--temp", "hot"])
    assert bad.returncode != 0
    assert bad.stderr.count("error: argument --temp") == 1, bad.stderr


def _unread(pipe) -> int:
    """Bytes written to ``pipe`` that its reader has not taken yet (Linux's FIONREAD)."""
    import array
    import fcntl
    import termios

    count = array.array("i", [0])
    fcntl.ioctl(pipe.fileno(), termios.FIONREAD, count)
    return count[0]


@pytest.mark.parametrize("max_tokens,moment", [(4, "idle at stdin"), (4000, "mid-generation")])
def test_ctrl_c_stops_every_rank_with_status_0(checkpoint, tmp_path, max_tokens, moment):
    """Ctrl-C (SIGINT to the terminal's process group) under launch/mpirun,
    while rank 0 waits for its next prompt (the first one answered, its
    summary printed) or while an answer is generated: every rank stops,
    status 0, no error line. Mid-generation, rank 1 is held 120 s at step 20
    (a test fault), so the answer is still under way whenever the Ctrl-C
    comes: on two busy cores this process has waited 12 s for a turn, longer
    than a whole answer of 4000 tokens takes."""
    import os
    import signal
    import subprocess
    import time

    from conftest import ROOT, interruptible, mpirun_env

    path = str(checkpoint("qwen3_moe"))
    env = mpirun_env()
    if moment == "mid-generation":
        env["MLXDIST_FAULT"] = "sleep:rank=1,layer=1,step=20,seconds=120"
    err = tmp_path / "err"
    with open(err, "wb") as err_file:
        proc = subprocess.Popen([str(ROOT / "launch" / "mpirun"), "-np", "2", "python", "-m", "mlxdist.run",
                                 "--model", path, "-m", str(max_tokens)], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=err_file, start_new_session=True,
                                preexec_fn=interruptible)
    proc.stdin.write(PROMPT.encode() + b"\n")
    proc.stdin.flush()
    # launch/mpirun passes stdin on once rank 0 opens its FIFO (the model loaded): the prompt is read
    reached = (lambda: "generation:" in err.read_text()) if moment == "idle at stdin" else \
        (lambda: _unread(proc.stdin) == 0)
    deadline = time.time() + 60
    while not reached() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert reached(), err.read_text()[-2000:]
    time.sleep(1.0)  # rank 0 back at its stdin, or the answer under way
    assert proc.poll() is None
    os.killpg(os.getpgid(proc.pid), signal.SIGINT)
    proc.stdin.close()
    proc.wait(timeout=60)
    said = err.read_text(errors="replace")
    assert proc.returncode == 0, said[-2000:]
    assert "mlxdist: error" not in said, said[-2000:]
    if moment == "mid-generation":
        assert "generation:" not in said  # the answer was cut short, not finished
    left = subprocess.run(["pgrep", "-f", path], capture_output=True, text=True).stdout.split()
    assert not left, f"ranks left running: {left}"


def test_launch_mpirun_streams_rank_0s_text_as_it_comes(checkpoint):
    """Rank 0's answer leaves launch/mpirun as it is generated, not a line at a
    time as Open MPI 5 forwards a rank's output: with rank 1 held 30 s at step
    100 (a test fault), the text of the steps before it arrives while rank 1
    is held, long before the job ends. (Through Open MPI, the test model's
    text showed nothing until after the hold.) The margin allows for this
    process waiting seconds for a turn on two busy cores."""
    import subprocess
    import time

    from conftest import ROOT, mpirun_env

    env = {**mpirun_env(), "MLXDIST_FAULT": "sleep:rank=1,layer=1,step=100,seconds=30"}
    proc = subprocess.Popen([str(ROOT / "launch" / "mpirun"), "-np", "2", "python", "-m", "mlxdist.run", "--model",
                             str(checkpoint("qwen3_moe")), "-p", PROMPT, "-m", "200"], cwd=ROOT, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.read1(64)
    first_at = time.time()
    rest = proc.stdout.read()
    said = proc.stderr.read().decode(errors="replace")
    proc.wait(120)
    ended_at = time.time()
    assert proc.returncode == 0 and first and rest, said[-2000:]
    assert ended_at - first_at > 10, f"the first text came {ended_at - first_at:.1f} s before the end"


@pytest.mark.parametrize("module", ["mlxdist.run", "mlxdist.doctor"])
def test_one_rank_under_mpirun_exits_0_without_open_mpis_banner(module):
    """``mpirun -np 1`` (docs/api.md): with MLX_MPI_LIBNAME set, MLX's first
    backend starts MPI; mpirun reported that rank as exiting improperly
    (status 1) after a correct run until it was finalized."""
    from mlxdist.runtime.libmpi import find_libmpi

    args = ["-p", "hi", "-m", 2] if module == "mlxdist.run" else []
    proc = launch(1, args, module=module, env={"MLX_MPI_LIBNAME": find_libmpi()})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "improperly" not in proc.stderr and "prterun" not in proc.stderr, proc.stderr[-2000:]
