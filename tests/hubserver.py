"""A stand-in for the Hugging Face hub's HTTP service, for tests on a machine
with no internet: it serves model folders as hub repos, speaking the part of
the hub's protocol that ``huggingface_hub`` (``snapshot_download``,
``HfApi.model_info``) uses. Point a process at it with ``HF_ENDPOINT``.

    GET  /api/models/ORG/NAME[/revision/REV]   the repo at REV (default main): its commit
                                               ("sha") and files ("siblings"; with ?blobs=true
                                               their sizes and blob ids)
    GET  /api/models/ORG/NAME/tree/REV         every file: type, path, size, oid
    HEAD /ORG/NAME/resolve/REV/FILE            a file's headers: ETag (its git blob id),
    GET  /ORG/NAME/resolve/REV/FILE            X-Repo-Commit, Content-Length; GET adds the bytes

REV is a branch or a full commit id. An unknown repo, revision or file is a
404 with the hub's ``X-Error-Code`` (RepoNotFound, RevisionNotFound,
EntryNotFound), which huggingface_hub turns into its own errors. Every
request is logged with the process that made it (found from the client's
port in /proc) and that process's ``OMPI_COMM_WORLD_RANK``. Files are served
whole (no ranges, no redirects to a CDN, no Xet), as the hub serves a file
that is not in LFS.
"""

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, List, Optional, Tuple
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass(frozen=True)
class Request:
    """One request the hub answered."""

    method: str
    path: str  # unquoted, without the query
    status: int
    pid: Optional[int]  # the client process, where /proc tells
    rank: Optional[str]  # that process's OMPI_COMM_WORLD_RANK, where it has one

    @property
    def file(self) -> Optional[str]:
        """The file a resolve request asked for."""
        parts = self.path.split("/", 5)  # ['', org, name, 'resolve', rev, file]
        return parts[5] if len(parts) == 6 and parts[3] == "resolve" else None


class Hub:
    """Repos of model folders, served over HTTP on 127.0.0.1 while ``start``ed."""

    def __init__(self):
        self.repos: Dict[str, Dict[str, str]] = {}  # repo id -> branch -> commit
        self.commits: Dict[str, Path] = {}  # commit -> folder
        self.log: List[Request] = []
        self.url: Optional[str] = None  # while started
        self._server: Optional[ThreadingHTTPServer] = None

    def add(self, repo_id: str, folder: Path, branch: str = "main") -> str:
        """Serve ``folder`` as the head of ``branch`` of ``repo_id``; returns its commit id."""
        commit = hashlib.sha1(f"{repo_id}@{branch}:{folder}".encode()).hexdigest()
        self.repos.setdefault(repo_id, {})[branch] = commit
        self.commits[commit] = Path(folder)
        return commit

    def start(self) -> str:
        """Serve in a thread; returns the endpoint's URL."""
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.hub = self
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def files(self, commit: str) -> Dict[str, Path]:
        """The commit's files by repo path (a folder's files, at any depth)."""
        folder = self.commits[commit]
        return {f.relative_to(folder).as_posix(): f for f in sorted(folder.rglob("*")) if f.is_file()}

    def resolve(self, repo_id: str, revision: str) -> Tuple[Optional[str], Optional[str]]:
        """(commit, None) or (None, the hub's error code)."""
        branches = self.repos.get(repo_id)
        if branches is None:
            return None, "RepoNotFound"
        if revision in branches:
            return branches[revision], None
        if revision in branches.values():  # a commit of this repo
            return revision, None
        return None, "RevisionNotFound"


def blob_id(data: bytes) -> str:
    """Git's id of a blob: what the hub gives as a file's oid and ETag."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # connections kept alive, as the hub's are

    @property
    def hub(self) -> Hub:
        return self.server.hub

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def log_message(self, *args) -> None:  # the log is Hub.log, not stderr
        pass

    def _answer(self, body: bool) -> None:
        pid = _client_pid(self.client_address[1], self.server.server_address[1])  # while the client waits
        url = urlsplit(self.path)
        path, query = unquote(url.path), parse_qs(url.query)
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            status = self._api(f"{parts[2]}/{parts[3]}", parts[4:], query, body)
        elif len(parts) >= 5 and parts[2] == "resolve":
            status = self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), body)
        else:
            status = self._send(404, b"", {}, body)
        self.hub.log.append(Request(self.command, path, status, pid, _rank_of(pid)))

    def _api(self, repo_id: str, rest: List[str], query: Dict[str, List[str]], body: bool) -> int:
        if rest[:1] == ["tree"] and len(rest) >= 2:
            commit, error = self.hub.resolve(repo_id, rest[1])
            if error:
                return self._send(404, b"", {"X-Error-Code": error}, body)
            tree = [{"type": "file", "path": name, "size": f.stat().st_size, "oid": blob_id(f.read_bytes())}
                    for name, f in self.hub.files(commit).items()]
            return self._json(tree, body)
        revision = rest[1] if rest[:1] == ["revision"] and len(rest) == 2 else "main"
        commit, error = self.hub.resolve(repo_id, revision)
        if error:
            return self._send(404, b"", {"X-Error-Code": error}, body)
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = [{"rfilename": name, **({"size": f.stat().st_size, "blobId": blob_id(f.read_bytes())}
                                            if blobs else {})}
                    for name, f in self.hub.files(commit).items()]
        return self._json({"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                           "siblings": siblings}, body)

    def _resolve(self, repo_id: str, revision: str, name: str, body: bool) -> int:
        commit, error = self.hub.resolve(repo_id, revision)
        if error:
            return self._send(404, b"", {"X-Error-Code": error}, body)
        file = self.hub.files(commit).get(name)
        if file is None:
            return self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit}, body)
        data = file.read_bytes()
        headers = {"ETag": f'"{blob_id(data)}"', "X-Repo-Commit": commit, "Accept-Ranges": "none",
                   "Content-Type": "application/octet-stream"}
        return self._send(200, data, headers, body)

    def _json(self, value, body: bool) -> int:
        return self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"}, body)

    def _send(self, status: int, data: bytes, headers: Dict[str, str], body: bool) -> int:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)
        return status


def _client_pid(client_port: int, server_port: int) -> Optional[int]:
    """The process holding the client end of a connection to this server, from
    /proc/net/tcp (the socket's inode) and every process's open files."""
    inode = None
    try:
        with open("/proc/net/tcp") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, remote = fields[1], fields[2]
                if int(local.split(":")[1], 16) == client_port and int(remote.split(":")[1], 16) == server_port:
                    inode = fields[9]
                    break
    except OSError:
        return None
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == target for fd in os.listdir(f"/proc/{pid}/fd")):
                return int(pid)
        except OSError:  # gone, or not ours to read
            continue
    return None


def _rank_of(pid: Optional[int]) -> Optional[str]:
    """The MPI rank a process was started as, from its environment."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return None
    rank = env.get(b"OMPI_COMM_WORLD_RANK")
    return rank.decode() if rank is not None else None
