"""What code a rank runs: each package's version and, where it can be told,
its commit. mlxdist's commit is that of the git checkout it runs from
(``+modified`` where the package's tracked files differ from it); a package
that pip installed from a git URL or as an editable checkout reports that
commit; any other reports none (its version names it)."""

import json
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlparse

import mlxdist

GIT_SECONDS = 5  # a git that takes longer (a network file system, a lock) is not waited for


def package_version(package: str) -> str:
    """The installed version of ``package`` ("-" where it is not installed)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "-"


def checkout_commit(folder: Path, package: Optional[str] = None) -> Optional[str]:
    """The 12-digit commit checked out at ``folder``, the top of a git
    checkout, with ``+modified`` where the tracked files under ``package``
    (a folder in it; default: all) differ from it; None where ``folder`` is
    no checkout's top or git is absent or slow."""
    if not (folder / ".git").exists():  # a folder inside another project's checkout is not this package's
        return None
    try:
        head = subprocess.run(["git", "-C", str(folder), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=GIT_SECONDS)
        if head.returncode != 0 or not head.stdout.strip():
            return None
        diff = subprocess.run(["git", "-C", str(folder), "diff", "--quiet", "HEAD", "--", package or "."],
                              capture_output=True, timeout=GIT_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+modified" if diff.returncode == 1 else "")


def installed_commit(package: str) -> Optional[str]:
    """The commit pip recorded for ``package`` (installed from a git URL),
    or that of the checkout an editable install points at; None otherwise."""
    try:
        text = metadata.distribution(package).read_text("direct_url.json")
        direct = json.loads(text) if text else {}
    except (metadata.PackageNotFoundError, ValueError):
        return None
    if not isinstance(direct, dict):
        return None
    vcs = direct.get("vcs_info")
    if isinstance(vcs, dict) and isinstance(vcs.get("commit_id"), str):
        return vcs["commit_id"][:12]
    url = direct.get("url")
    if isinstance(direct.get("dir_info"), dict) and direct["dir_info"].get("editable") and isinstance(url, str) \
            and url.startswith("file://"):
        return checkout_commit(Path(unquote(urlparse(url).path)))
    return None


def mlxdist_commit() -> Optional[str]:
    """The commit of the mlxdist this process imported: its checkout's where
    it runs from one, else what pip recorded."""
    package = Path(mlxdist.__file__).resolve().parent
    return checkout_commit(package.parent, package.name) or installed_commit("mlxdist")
