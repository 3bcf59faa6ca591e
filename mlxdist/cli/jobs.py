"""Job files: many prompts in, one result line per job out, resumable.

    mpirun -np 4 python -m mlxdist.run --model M --jobs prompts.jsonl --out results.jsonl

Input: one JSON object per line with ``id`` and ``prompt`` or ``messages``,
plus optional sampling parameters (max_tokens, temp, top_p, top_k, min_p,
seed) overriding the command line's. Output: one JSON object per finished
job, appended and flushed to disk as each batch finishes. A rerun skips the
ids already in the output (a half-written last line, left by a crash, is cut
off first), so nothing is lost and nothing is written twice. A malformed
input line becomes a record with an ``error`` field and the run goes on.
"""

import json
import os
import sys
import time
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

from tqdm import tqdm

from mlxdist.errors import UserError

SAMPLING_KEYS = ("max_tokens", "temp", "top_p", "top_k", "min_p", "seed")


@dataclass
class Job:
    id: str
    prompt: Optional[str]
    messages: Optional[list]
    sampling: Dict[str, Any]

    def sampling_key(self) -> Tuple:
        return tuple(sorted(self.sampling.items()))


def parse_job(line: str, lineno: int, defaults: Dict[str, Any]) -> Job:
    """One input line as a job; raises ValueError with the reason."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {lineno} is not JSON: {e.msg}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"line {lineno} is not a JSON object")
    if "id" not in obj:
        raise ValueError(f"line {lineno} has no id")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError(f"job {obj['id']!r} needs exactly one of prompt or messages")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"job {obj['id']!r}: prompt is not a string")
    if messages is not None and not (
        isinstance(messages, list) and all(isinstance(m, dict) and "content" in m for m in messages)
    ):
        raise ValueError(f"job {obj['id']!r}: messages must be a list of {{role, content}} objects")
    sampling = dict(defaults)
    sampling.update({k: obj[k] for k in SAMPLING_KEYS if k in obj})
    return Job(str(obj["id"]), prompt, messages, sampling)


def read_jobs(path: str, defaults: Dict[str, Any]) -> Iterator[Tuple[str, Any]]:
    """("job", Job) or ("error", record) per non-blank input line."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield "job", parse_job(line, lineno, defaults)
            except ValueError as e:
                obj_id = _id_of(line) or f"line:{lineno}"
                yield "error", {"id": obj_id, "error": str(e)}


def _id_of(line: str) -> Optional[str]:
    try:
        obj = json.loads(line)
        return str(obj["id"]) if isinstance(obj, dict) and "id" in obj else None
    except json.JSONDecodeError:
        return None


def finished_ids(out_path: str) -> Set[str]:
    """Ids already in the output, after cutting off a half-written last line."""
    path = Path(out_path)
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(cut)
        print(f"mlxdist: repaired {out_path}: dropped a half-written last line", file=sys.stderr)
    return recorded_ids(out_path)


def recorded_ids(out_path: str) -> Set[str]:
    """Ids in the output's complete lines; reads only, so it is safe while a
    job is appending to the file."""
    path = Path(out_path)
    data = path.read_bytes() if path.exists() else b""
    done = set()
    for line in data[: data.rfind(b"\n") + 1].decode().splitlines():
        try:
            done.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return done


class ResultWriter:
    """Appends records and makes each one durable before the next."""

    def __init__(self, out_path: str):
        self.file = open(out_path, "a")

    def write(self, record: Dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


def run_jobs(cluster, jobs_path: str, out_path: str, defaults: Dict[str, Any], batch_size: int = 8) -> int:
    """Run every job not yet in ``out_path``; returns the exit code."""
    try:
        entries = list(read_jobs(jobs_path, defaults))
    except OSError as e:
        raise UserError(f"cannot read job file {jobs_path}: {e.strerror}") from None
    done = finished_ids(out_path)
    writer = ResultWriter(out_path)
    seen: Set[str] = set(done)
    pending: List[Job] = []
    bar = tqdm(total=len(entries), initial=0, unit="job", desc="jobs", file=sys.stderr, dynamic_ncols=True)
    for kind, entry in entries:
        entry_id = entry.id if kind == "job" else entry["id"]
        if entry_id in seen:
            bar.update(1)
            continue
        seen.add(entry_id)
        if kind == "error":
            writer.write(entry)
            bar.update(1)
        else:
            pending.append(entry)
    tokens, tic = 0, time.perf_counter()
    for _, group in groupby(sorted(pending, key=lambda j: repr(j.sampling_key())), key=lambda j: repr(j.sampling_key())):
        group = list(group)
        for start in range(0, len(group), batch_size):
            batch = _runnable(cluster, group[start : start + batch_size], writer, bar)
            if not batch:
                continue
            t0 = time.perf_counter()
            results = cluster.generate_batch(
                [j.messages if j.messages is not None else j.prompt for j in batch], **batch[0].sampling
            )
            elapsed = time.perf_counter() - t0
            for job, result in zip(batch, results):
                writer.write({
                    "id": job.id,
                    "text": result.text,
                    "tokens": result.tokens,
                    "prompt_tokens": result.stats.get("prompt_tokens"),
                    "generation_tps": result.stats.get("generation_tps"),
                    "batch_size": len(batch),
                    "elapsed_s": round(elapsed, 4),
                })
                tokens += len(result.tokens)
            bar.update(len(batch))
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - tic):.1f} tok/s")
    bar.close()
    writer.close()
    return 0


def _runnable(cluster, jobs: List[Job], writer: ResultWriter, bar) -> List[Job]:
    """The jobs whose prompt and parameters are valid; the rest become error records."""
    ok = []
    for job in jobs:
        try:
            cluster.request([cluster.encode(job.prompt, job.messages)], **job.sampling)
            ok.append(job)
        except (UserError, TypeError, ValueError) as e:
            writer.write({"id": job.id, "error": str(e)})
            bar.update(1)
    return ok
