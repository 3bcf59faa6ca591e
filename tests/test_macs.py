"""A Mac's first hour as docs/macs.md writes it: every mpirun that crosses
Macs says where Open MPI lives (--prefix), in the docs, the hostfile and
supervise's own launch; nothing ties Open MPI to bridge0, which
mlx.distributed_config --auto-setup takes down; Kimi K2's tokenizer
package is installable by name; and a rank whose Thunderbolt addresses a
restart took away says so instead of waiting."""

import json
import re
import sys
from pathlib import Path

import pytest

from conftest import ROOT, launch

from mlxdist.cli.relaunch import RankSlot, mpirun_command, open_mpi_prefix

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "hostfiles/macs.txt"]


def _commands(text: str):
    """Each shell command of a page (continued lines joined), without its leading '#'."""
    lines = [re.sub(r"^\s*#?\s*", "", line) for line in text.splitlines()]
    joined, current = [], ""
    for line in lines:
        current += " " + line
        if not line.endswith("\\"):
            joined.append(current.replace("\\", " ").strip())
            current = ""
    return joined


def test_every_mpirun_across_macs_in_the_docs_gives_prefix():
    """launch/mpirun adds --prefix itself; a bare mpirun with a hostfile must say it."""
    missing, seen = [], 0
    for page in DOCS:
        for command in _commands(page.read_text()):
            if re.search(r"(^|[\s=])mpirun\s", command) and "--hostfile" in command and "launch/mpirun" not in command:
                seen += 1
                if "--prefix" not in command:
                    missing.append(f"{page.name}: {command[:120]}")
    assert seen >= 4 and not missing, missing


def _anchors(text: str):
    """GitHub's anchors of a page's headings."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_open_mpi_is_not_tied_to_bridge0_after_auto_setup_and_restarts_are_covered():
    text = (ROOT / "docs/macs.md").read_text()
    assert "--auto-setup" in text
    assert "if_include bridge0" not in text and "MLXDIST_RING_INTERFACE=bridge0" not in text
    linked = re.findall(r"docs/macs\.md#([\w-]+)", (ROOT / "mlxdist/runtime/backends.py").read_text())
    assert linked == ["6-after-a-restart"] and set(linked) <= _anchors(text)
    assert "4-mpirun-across-macs---prefix-and-a-short-tmpdir" in _anchors(text)  # launchers.md links it


def test_kimi_needs_tiktoken_and_an_extra_installs_it():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["kimi"] == ["tiktoken"]
    assert "mlxdist[kimi]" in (ROOT / "docs/macs.md").read_text()


def test_supervise_gives_mpirun_the_prefix_across_hosts(tmp_path):
    """Across hosts, the prefix is the folder above mpirun's where prted is
    beside it (PyPI's and Homebrew's Open MPI alike); a wrapper gets none
    (launch/mpirun adds its own); on one host, neither --prefix nor --host."""
    slots = [RankSlot("mac-1"), RankSlot("mac-1"), RankSlot("mac-2")]
    mpirun = Path(sys.executable).parent / "mpirun"
    cmd = mpirun_command(str(mpirun), slots, True, ["--jobs", "j", "--out", "o"])
    assert cmd[:6] == [str(mpirun), "-np", "3", "--oversubscribe", "--bind-to", "none"]
    assert cmd[6:10] == ["--prefix", str(mpirun.parent.parent), "--host", "mac-1:2,mac-2:1"]
    assert cmd[10:] == [sys.executable, "-m", "mlxdist.run", "--jobs", "j", "--out", "o"]
    brew = tmp_path / "opt/open-mpi"
    (brew / "bin").mkdir(parents=True)
    for name in ("mpirun", "prted"):
        (brew / "bin" / name).write_text("")
    assert open_mpi_prefix(str(brew / "bin/mpirun")) == str(brew)
    linked = tmp_path / "homebrew/bin"  # Homebrew links bin/mpirun and bin/prted into its Cellar
    linked.mkdir(parents=True)
    for name in ("mpirun", "prted"):
        (linked / name).symlink_to(brew / "bin" / name)
    assert open_mpi_prefix(str(linked / "mpirun")) == str(linked.parent)
    (linked / "prted").unlink()  # not linked: where the link points
    assert open_mpi_prefix(str(linked / "mpirun")) == str(brew)
    assert open_mpi_prefix(str(ROOT / "launch/mpirun")) is None
    assert "--prefix" not in mpirun_command(str(ROOT / "launch/mpirun"), slots, True, [])
    alone = mpirun_command(str(mpirun), slots[:2], False, [])
    assert "--prefix" not in alone and "--host" not in alone


def test_a_start_that_does_not_connect_names_a_restart_first_on_macs():
    from mlxdist.runtime.backends import connect_failure_causes

    assert connect_failure_causes(darwin=True).startswith(
        "likely the Thunderbolt addresses mlx.distributed_config --auto-setup sets are gone after a Mac restarts: "
        "run that command again (docs/macs.md#6-after-a-restart); else a firewall")
    assert connect_failure_causes(darwin=False).startswith("a firewall, a link down")


def test_a_rank_without_its_ring_address_says_so_instead_of_waiting(tmp_path):
    """Under mlx.launch --backend ring, rank 1's hostfile address is on no
    interface of its host (as after a restart undid --auto-setup): one line
    from rank 1 itself, status 1, before MLX's ring would wait for ever."""
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps([["127.0.0.1:45001"], ["192.0.2.7:45002"]]))
    env = {"MLX_HOSTFILE": str(hostfile), "MLX_RANK": "1", "MLX_WORLD_SIZE": "2"}
    proc = launch(0, ["-p", "hi", "-m", "2"], env=env, timeout=60)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mlxdist: error:")]
    assert lines == ["mlxdist: error: rank 1: this host has none of the addresses the ring hostfile gives it "
                     "(192.0.2.7); the Thunderbolt addresses mlx.distributed_config --auto-setup sets are gone after "
                     "a Mac restarts: run that command again (docs/macs.md#6-after-a-restart)"], proc.stderr[-2000:]
