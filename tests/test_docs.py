"""The docs followed literally: every shell block of README.md, docs/, examples/ and hostfiles/
runs as written, or is parsed by the command's own parser, or is listed with the reason it
cannot run here (a Mac, a GPU, several hosts, minutes of benchmark).

A block runs in a folder of its own that links the repository's folders, so its files
(results.jsonl, routing.json, ...) land there; placeholders are bound to a tiny model written
by ``python -m mlxdist.synth``: DIR, M, MODEL, CKPT, T and a hub id. Optional arguments in
brackets are left out, ``...`` is left out or bound per block. Every path a page names in the
repository exists, or is said to be removed, beside the commit that has it."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from mlxdist.runtime.launcher import new_session_base, session_env

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs/notes").glob("*.md")),
         *sorted((ROOT / "examples").glob("*.py")), *sorted((ROOT / "hostfiles").glob("*.txt"))]
LINKED = [".venv", "launch", "examples", "tests", "hostfiles", "benchmarks", "mlxdist", "pyproject.toml"]
COMMAND = re.compile(r"^(launch/|python3?\s|mpirun\s|mlx\.launch\s|mlx\.distributed_config\s|benchmarks/|curl\s|"
                     r"pip\s|brew\s|git\s|ssh|echo\s|sudo\s|cd\s|~/|[A-Za-z_]\w*=\S*\s)")
HUB_ID = r"mlx-community/[\w.-]+"

# Blocks run as written (after binding): (page, the block's first command line starts with) ->
# (timeout in s, {text: replacement} for this block, what its output must hold (regex) or None).
RUN = {
    # the block's second line, launch/test, is the test suite itself
    ("README.md", "launch/mpirun -np 4 python -m mlxdist.run -p"): (240, {"\nlaunch/test": ""}, r"generation: 32 tokens"),
    ("README.md", "launch/mpirun -np 2 python -m mlxdist.run --model mlx-community"): (180, {}, r"generation:"),
    ("README.md", "launch/mpirun -np 2 python -m mlxdist.run --model DIR --jobs"): (180, {}, None),
    ("README.md", "launch/mpirun -np 2 python examples/api_example.py"): (180, {}, r"batch of 3"),
    ("README.md", "python -m mlxdist.synth /tmp/ck"): (120, {}, None),
    ("docs/placement.md", "# 1. record"): (360, {"...": "-p Hello -m 4"}, None),
    ("docs/placement.md", "python -m mlxdist.run --model DIR --save-placement"): (240, {"...": "-p Hello -m 4"}, None),
    ("docs/memory.md", "launch/mpirun -np 2 python -m mlxdist.run --model DIR --expert-capacity"):
        (180, {"-p \"Hello\"": "-p Hello -m 8"}, r"generation:"),
    ("docs/memory.md", "python -m mlxdist.model.fit"): (120, {}, r"qwen3|deepseek|kimi|gpt", ),
    ("docs/benchmarks.md", "python -m mlxdist.synth T"): (180, {}, None),
    ("docs/benchmarks.md", "python -m mlxdist.bench mlxlm --model M -p 512"):
        (180, {"-p 512 -g 128 -b 1,8,32 -n 3": "-p 16 -g 4 -b 1 -n 1 --warmup-tokens 2"}, r"b=1: prompt"),
    ("docs/notes/openmpi-start.md", "launch/mpirun -np 2 python -c"): (120, {}, r"^\d+\.\d+"),
    ("examples/api_example.py", "launch/mpirun -np 2 python examples/api_example.py"): (180, {}, r"batch of 3"),
    ("docs/api.md", "mlx.launch --backend ring -n 2"): (180, {}, r"generation:"),
    ("docs/launchers.md", "python -m mlxdist.launch --backend ring -n 4"): (240, {}, r"^0$"),
    ("docs/api.md", "launch/mpirun -np 2 python examples/api_example.py"): (180, {}, r"batch of 3"),
}

# Blocks not launched, parsed by the command's own parser instead (every option exists and
# takes its value): (page, prefix) -> why not launched.
PARSE = {
    ("README.md", "launch/mpirun -np 2 python -m mlxdist.serve"): "a server waits for requests until stopped (tests/test_serve.py)",
    ("docs/serving.md", "launch/mpirun -np 2 python -m mlxdist.serve"): "a server waits for requests until stopped (tests/test_serve.py)",
    ("docs/serving.md", "python -m mlxdist.serve --ranks 2"): "the front serves until stopped (tests/test_front.py)",
    ("docs/api.md", "launch/mpirun -np 2 python -m mlxdist.run --model DIR -p \"Hello\" --backend ring"): "the ring backend on one host: tests/test_backends.py",
    ("docs/launchers.md", "launch/mpirun -np 2 python -m mlxdist.run --model DIR -p \"Hello\" --backend ring"): "the ring backend on one host: tests/test_backends.py",
    ("docs/api.md", "launch/mpirun -np 2 python -m mlxdist.run --model M --jobs"): "README's job-file command (run there)",
    ("docs/macs.md", "launch/mpirun -np 2 python -m mlxdist.run -p"): "README's first command on 2 ranks",
    ("docs/memory.md", "launch/mpirun -np 2 python -m mlxdist.run --model DIR --memory-budget"): "the paging run above, by budget (tests/test_paging.py)",
    ("docs/failures.md", "launch/mpirun --survive -np 3"): "a job that survives a lost rank: tests/test_reliability.py loses one",
    ("docs/modes.md", "launch/mpirun -np 2 python -m mlxdist.run --remeasure"): "a load measured again: tests/test_decision.py",
    ("docs/benchmarks.md", "launch/mpirun -np 2 python -m mlxdist.bench --model DIR -p 512"): "minutes as written: tests/test_bench.py runs it small",
    ("docs/benchmarks.md", "launch/mpirun -np 2 python -m mlxdist.bench --model DIR -b 1 --mode"): "speculative rounds: tests/test_bench_speculative.py",
    ("docs/notes/openmpi-start.md", "OMPI_MCA_mpi_yield_when_idle=0|1"): "README's run with one MCA variable, either value",
}

# Blocks that cannot run here, with the reason.
SKIP = {
    ("README.md", "launch/setup.sh"): "creates the environment the tests run in",
    ("docs/api.md", "python -m mlxdist.run [--model"): "a synopsis of options, not a command",
    ("docs/modes.md", "python -m mlxdist.run --mode auto|"): "a synopsis of options, not a command",
    ("docs/api.md", "python -m mlxdist.place ROUTING.json"): "a synopsis; docs/placement.md's pipeline runs it",
    ("docs/failures.md", "python -m mlxdist.supervise --ranks 3"): "a synopsis; tests/test_supervise.py restarts on fewer ranks",
    ("docs/failures.md", "python -m mlxdist.serve --ranks 3"): "a synopsis; tests/test_recovery.py loses ranks under it",
    ("docs/launchers.md", "mlx.launch --backend ring -n 2"): "its second line starts a server that waits for requests; the first is docs/api.md's, run there",
    ("docs/launchers.md", "mlx.launch --backend jaccl"): "several Macs with RDMA",
    ("docs/launchers.md", "MLXDIST_JACCL_DEVICES=hosts.json"): "several Macs with RDMA",
    ("docs/api.md", "EXTRAS=cuda launch/setup.sh"): "a GPU",
    ("docs/SECURITY.md", "mpirun --prefix"): "several Macs",
    ("docs/macs.md", "brew install"): "a Mac",
    ("docs/macs.md", "~/mlxdist/.venv/bin/pip install -e"): "a Mac's clone in ~/mlxdist",
    ("docs/macs.md", "ssh-keygen"): "several Macs",
    ("docs/macs.md", "echo 'export TMPDIR=/tmp'"): "a Mac's shell profile",
    ("docs/macs.md", "mlx.distributed_config"): "several Macs with Thunderbolt",
    ("docs/macs.md", "mpirun --prefix"): "several Macs",
    ("docs/macs.md", "mlx.launch --backend jaccl"): "several Macs with RDMA",
    ("docs/memory.md", "launch/mpirun -np 2 python benchmarks/transfer.py"): "512 MB x 5 rounds: a measurement of the link",
    ("docs/memory.md", "launch/mpirun -np 4 --hostfile H python -m mlxdist.doctor"): "several hosts: tests/test_doctor.py",
    ("docs/memory.md", "sudo sysctl"): "a Mac's GPU",
    ("docs/memory.md", "python -m mlxdist.synth DIR --preset gpt_oss"): "bench capacity: minutes (tests/test_bench.py)",
    ("docs/benchmarks.md", "benchmarks/compare"): "many launches per contender: many minutes (tests/test_bench.py)",
    ("docs/benchmarks.md", "python -m mlxdist.bench compare"): "many launches per contender: many minutes",
    ("docs/benchmarks.md", "launch/mpirun -np 2 python -m mlxdist.bench mlxlm"): "mlx-lm's tensor, pipeline and replicas contenders: tests/test_bench.py",
    ("docs/placement.md", "# even, balanced"): "three placements side by side: minutes (tests/test_bench.py)",
    ("docs/serving.md", "python -m mlxdist.bench stress"): "10,000 requests: minutes (tests/test_stress.py)",
    ("docs/serving.md", "python -m mlxdist.bench turns"): "three servers, 3,400-token turns: minutes (the results page's run)",
    ("docs/notes/auto-rows-per-rank.md", "CONTENDERS="): "a GPU",
    ("docs/notes/auto-rows-per-rank.md", "benchmarks/compare"): "many minutes: the note's measurement",
    ("docs/notes/gpu-masked-layout.md", "CONTENDERS="): "a GPU",
    ("docs/notes/gpu-masked-layout.md", "benchmarks/compare"): "many minutes: the note's measurement",
    ("docs/notes/grouped-experts.md", "git show"): "a GPU",
    ("docs/notes/nccl-channels.md", "git worktree"): "a GPU",
    ("docs/notes/openmpi-thread-level.md", "SHARE_GPU=0"): "a GPU",
}


def _blocks(text: str):
    """Each code block of a Markdown text: (language or 'indent', text)."""
    out, lines, i, blank = [], text.splitlines(), 0, True
    while i < len(lines):
        fence = re.match(r"^\s*```(\w*)", lines[i])
        if fence:
            body, i = [], i + 1
            while i < len(lines) and not lines[i].lstrip().startswith("```"):
                body.append(lines[i])
                i += 1
            out.append((fence.group(1), "\n".join(body)))
            i, blank = i + 1, False
            continue
        if blank and lines[i].startswith("    ") and lines[i].strip():
            body = []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            out.append(("indent", "\n".join(body).strip("\n")))
            continue
        blank = not lines[i].strip()
        i += 1
    return out


def _page_text(page: Path) -> str:
    if page.suffix == ".py":
        return (page.read_text().split('"""') + ["", ""])[1]  # the module docstring
    if page.suffix == ".txt":  # a hostfile's comment block
        return "\n".join(re.sub(r"^# ?", "", l) for l in page.read_text().splitlines() if l.startswith("#"))
    return page.read_text()


def _shell_blocks():
    """(page, first command line, block) of every shell block on the pages."""
    found = []
    for page in PAGES:
        for language, body in _blocks(_page_text(page)):
            if language not in ("indent", "", "sh", "bash", "shell"):
                continue
            lines = [l for l in body.splitlines() if l.strip()]
            commands = [l.strip() for l in lines if not l.lstrip().startswith("#")]
            if commands and COMMAND.match(commands[0]):
                found.append((str(page.relative_to(ROOT)), lines[0].strip(), body))
    return found


def _listed(table: dict, page: str, first: str):
    return [key for key in table if key[0] == page and first.startswith(key[1])]


BLOCKS = _shell_blocks()


def test_every_shell_block_is_run_parsed_or_skipped_with_a_reason():
    unlisted = [f"{page}: {first}" for page, first, _ in BLOCKS
                if not any(_listed(t, page, first) for t in (RUN, PARSE, SKIP))]
    assert not unlisted, "shell blocks the test neither runs nor gives a reason for:\n" + "\n".join(unlisted)
    unused = [key for t in (RUN, PARSE, SKIP) for key in t
              if not any(page == key[0] and first.startswith(key[1]) for page, first, _ in BLOCKS)]
    assert not unused, f"entries that match no block any more: {unused}"
    reasonless = [key for key in SKIP if not SKIP[key]]
    assert not reasonless, reasonless
    skipped = sum(1 for page, first, _ in BLOCKS if _listed(SKIP, page, first))
    print(f"{len(BLOCKS)} shell blocks, {skipped} not run here:")
    for page, first, _ in BLOCKS:
        for key in _listed(SKIP, page, first) + _listed(PARSE, page, first):
            print(f"  {page}: {first[:70]}  ({SKIP.get(key) or PARSE.get(key)})")


def _bind(block: str, model: Path, work: Path, extra: dict) -> str:
    """The block with its placeholders bound: optional [...] left out, ... as extra says."""
    text = block.replace("\\\n", " ")
    for old, new in extra.items():
        text = text.replace(old, new)
    while re.search(r"\s\[[^\[\]]*\]", text):
        text = re.sub(r"\s\[[^\[\]]*\]", "", text)
    text = re.sub(r"\s\.\.\.(?=\s|$)", "", text)
    text = re.sub(HUB_ID, str(model), text)
    text = re.sub(r"--model (DIR|MODEL|M|CKPT|T)(?=\s|$)", f"--model {model}", text)
    text = re.sub(r"/tmp/ck\b", str(work / "ck"), text)
    text = re.sub(r"(mlxdist\.synth) (T|D|DIR)(?=\s)", lambda m: f"{m.group(1)} {work / m.group(2)}", text)
    text = re.sub(r"--draft-of T\b", f"--draft-of {work / 'T'}", text)
    return text


@pytest.fixture(scope="module")
def docs_model(tmp_path_factory):
    """The tiny model placeholders bind to, and a work folder linking the repository's."""
    work = tmp_path_factory.mktemp("docs")
    for name in LINKED:
        (work / name).symlink_to(ROOT / name)
    model = work / "model"
    subprocess.run([sys.executable, "-m", "mlxdist.synth", str(model)], check=True, capture_output=True, timeout=300)
    prompts = ["Hello", "Explain MoE routing.", "One two three"]
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "max_tokens": 8}) + "\n" for p in prompts))
    return model, work


def _env(work: Path) -> dict:
    """The user's shell: the environment's python first on PATH; no root permissions of
    the tests' own (launch/mpirun adds them); a bare mpirun's session folder of the
    block's own (conftest.mpirun_env says why)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_MCA_rmaps"))}
    env.update(PATH=f"{ROOT / '.venv/bin'}{os.pathsep}{env.get('PATH', '')}", HF_HUB_OFFLINE="1",
               MLXDIST_CACHE=str(work / "cache"), **session_env(new_session_base(str(work))))
    return env


_RAN = {}  # bound script -> its completed process


@pytest.mark.parametrize("key", sorted(RUN), ids=lambda k: f"{k[0]}:{k[1][:40]}")
def test_block_runs_as_written(key, docs_model):
    model, work = docs_model
    timeout, extra, claim = RUN[key]
    blocks = [body for page, first, body in BLOCKS if page == key[0] and first.startswith(key[1])]
    assert len(blocks) == 1, f"{key}: {len(blocks)} blocks"
    script = _bind(blocks[0], model, work, extra)
    if script not in _RAN:  # pages that repeat a command run it once
        _RAN[script] = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=_env(work),
                                      capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    proc = _RAN[script]
    assert proc.returncode == 0, f"{script}\nexit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    if claim:
        assert re.search(claim, proc.stdout + proc.stderr, re.M), f"{script}: no {claim!r} in\n{proc.stdout[-2000:]}"


def test_the_blocks_files_are_what_the_pages_say(docs_model):
    """After the runs: --out holds one record per prompt; --record-routing wrote a routing file."""
    _, work = docs_model
    if not (work / "results.jsonl").exists() or not (work / "routing.json").exists():
        pytest.skip("runs only after the job-file and placement blocks")
    assert len((work / "results.jsonl").read_text().splitlines()) == 3
    assert json.loads((work / "routing.json").read_text())["kind"] == "mlxdist-routing"


def _parsers():
    from mlxdist.bench.harness import parse_args as bench_args
    from mlxdist.cli.place import build_parser as place
    from mlxdist.cli.run import build_parser as run
    from mlxdist.cli.serve import build_parser as serve
    from mlxdist.front.settings import build_front_parser as front

    def serve_args(argv):  # --ranks: the front's options too
        return (front() if "--ranks" in argv else serve()).parse_args(argv)

    return {"mlxdist.run": run().parse_args, "mlxdist.serve": serve_args,
            "mlxdist.place": place().parse_args, "mlxdist.bench": bench_args}


def test_blocks_not_launched_parse(tmp_path):
    """Each PARSE block's python -m command takes its options as written."""
    parsers, checked = _parsers(), 0
    for key in PARSE:
        blocks = [body for page, first, body in BLOCKS if page == key[0] and first.startswith(key[1])]
        assert len(blocks) == 1, key
        line = _bind(blocks[0], tmp_path, tmp_path, {})
        found = re.search(r"python -m (mlxdist\.\w+) (.*)$", line.splitlines()[0])
        assert found and found.group(1) in parsers, f"{key}: no command a parser here knows"
        parsers[found.group(1)](shlex.split(found.group(2), comments=True))
        checked += 1
    assert checked == len(PARSE)


def test_every_repository_path_a_page_names_exists_or_names_its_commit():
    paths = re.compile(r"(?<![\w/.:-])((?:benchmarks|tests|launch|examples|hostfiles)/[\w./-]*\w)")
    missing = []
    for page in [*PAGES, *sorted((ROOT / "benchmarks/results").glob("*.md"))]:
        text = page.read_text()
        for found in paths.finditer(text):
            around = text[max(0, found.start() - 200):found.end() + 200]
            if not found.group(1).startswith("benchmarks/out") and not (ROOT / found.group(1)).exists() and not (
                    re.search(r"\b[0-9a-f]{7,40}\b", around) and "removed" in around):
                missing.append(f"{page.relative_to(ROOT)}: {found.group(1)}")
    assert not missing, missing


def _anchors(text: str) -> set:
    """GitHub's anchors of a page's headings."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_every_link_between_pages_reaches_a_file_and_its_heading():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks/results").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"\w+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_bench_mlxlm_help_lists_its_own_options():
    """docs/benchmarks.md: `--help` lists every option of bench mlxlm (it showed the mlxdist harness's)."""
    proc = subprocess.run([sys.executable, "-m", "mlxdist.bench", "mlxlm", "--help"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and "python -m mlxdist.bench mlxlm" in proc.stdout, proc.stderr[-2000:]
    assert "--contender {single,tensor,pipeline,instances}" in proc.stdout and "--instances" in proc.stdout


def test_options_named_inline_exist():
    """Every --option of a `python -m mlxdist...` command written inline in a page is in that
    command's --help (the issue was `python -m mlxdist.cache --json`, which only `list` takes)."""
    wanted = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for span in re.findall(r"`(python -m mlxdist\.[^`]*)`", page.read_text()):
            words = span.split()
            command = []
            for word in words[2:]:
                if word.startswith(("-", "[", ".", ">")) or not re.fullmatch(r"[a-z][\w.-]*", word):
                    break
                command.append(word)
            options = {w for w in re.findall(r"--[\w-]+", span)} - {"--help"}
            if options:
                wanted.setdefault(tuple(command), set()).update((page.name, o) for o in options)
    missing = []
    for command, options in wanted.items():
        proc = subprocess.run([sys.executable, "-m", *command, "--help"], capture_output=True, text=True,
                              timeout=120, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        missing += [f"{page}: python -m {' '.join(command)} {option}" for page, option in sorted(options)
                    if option not in proc.stdout]
    assert not missing, missing
