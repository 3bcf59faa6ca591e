"""Job files: many prompts in, one result line per job out, resumable, and
always run to the end.

    mpirun -np 4 python -m mlxdist.run --model M --jobs prompts.jsonl --out results.jsonl

Input: one JSON object per line with ``id`` and ``prompt`` or ``messages``,
plus optional sampling parameters (max_tokens, temp, top_p, top_k, min_p,
seed, num_draft_tokens, prompt_lookup_ngram) overriding the command line's;
with a draft model or prompt lookup, jobs run one at a time, speculatively. Every line is read with bounded cost
(``MAX_LINE_BYTES``, and ``json_input``'s limits) and every field is
checked on rank 0 before anything is broadcast: a bad line becomes an error
record for its id (``{"id", "error", "line"}``), one warning on stderr, and
the run goes on. Ids are strings (an integer id is its ``str()``); the same id
twice refuses the whole file before anything runs.

Output: one JSON object per finished job, appended and fsynced as each batch
finishes, by one run at a time (``flock`` on the file), to a regular file
that is not the job file; a record it will not take (a full disk) ends the
run with one line. A rerun cuts off a
half-written last line, reports and ignores damaged lines, and skips the ids
already recorded (error records too, unless ``retry_errors``), so nothing is
lost and nothing is written twice.
"""

import os
import sys
import time
from dataclasses import dataclass
from itertools import groupby
from typing import Any, Dict, List, Optional, Set, Union

from tqdm import tqdm

from mlxdist.errors import GenerationFailed, UserError, one_line, say_error

from mlxdist.cli.job_file import INPUT_ERROR, BadLine, Entry, Job, error_record, is_integer, load_job_file, show_value
from mlxdist.cli.job_results import OutputError, ResultsFile, warn

__all__ = ["INPUT_ERROR", "JobRun", "open_jobs", "run_jobs"]


# -- the run ----------------------------------------------------------------

@dataclass
class JobRun:
    """A job file ready to run: its entries read and checked, its output
    locked. Made before the model is loaded, so a refused file costs nothing."""

    jobs_path: str
    entries: List[Entry]
    out: ResultsFile
    done: Set[str]
    templated: bool = True  # a prompt goes through the chat template, as -p's does
    system_prompt: Optional[str] = None

    def prompt_of(self, cluster, job: Job) -> Union[str, List[Dict[str, Any]]]:
        """What ``job`` generates from: its messages; or its prompt as ``-p``
        takes one: through the tokenizer's chat template (after the system
        prompt), unless the run ignores the template or there is none."""
        if job.messages is not None:
            return job.messages
        if not self.templated or not cluster.engine.tokenizer.has_chat_template:
            return job.prompt
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        return [*system, {"role": "user", "content": job.prompt}]

    def close(self) -> None:
        """Release the output."""
        self.out.close()


def open_jobs(jobs_path: str, out_path: str, defaults: Dict[str, Any], retry_errors: bool = False,
              templated: bool = True, system_prompt: Optional[str] = None) -> JobRun:
    """Read and check the job file, then lock and read the output. Raises
    ``UserError`` (unreadable file, duplicate ids, output held by another run).
    ``templated`` / ``system_prompt``: how prompt lines are encoded (``JobRun.prompt_of``)."""
    entries = load_job_file(jobs_path, defaults)
    if _same_file(jobs_path, out_path):
        raise UserError(f"--out {out_path} is the job file {jobs_path}: the results would be appended to the jobs; "
                        f"give another file")
    out = ResultsFile(out_path)
    try:
        done = out.finished(retry_errors)
    except BaseException:
        out.close()
        raise
    return JobRun(jobs_path, entries, out, done, templated, system_prompt)


def _same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (a symlink, a hard link, another spelling)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet)
        return False


def run_jobs(cluster, jobs: Union[JobRun, str], out_path: Optional[str] = None,
             defaults: Optional[Dict[str, Any]] = None, batch_size: int = 8, retry_errors: bool = False) -> int:
    """Run every job not yet finished in the output; returns the exit code
    (0: every line has a record). ``jobs``: an ``open_jobs`` result, or the
    job file's path (then ``out_path`` and ``defaults`` are opened here)."""
    run = jobs if isinstance(jobs, JobRun) else open_jobs(jobs, out_path, defaults or {}, retry_errors)
    try:
        return _run(cluster, run, batch_size)
    except OutputError as e:  # rank 0's file: the other ranks are waiting for the next command, not in a step
        with tqdm.external_write_mode(file=sys.stderr):  # on a line of its own, not after the bar
            say_error(str(e))
        return 1
    finally:
        run.close()


def _record_error(run: JobRun, job_id: str, reason: str, line: int, bar) -> None:
    """Write a job's error record, with one warning line. Every reason names
    its line but the ranges ``GenerationParams`` checks, kept in the words the
    API uses (the record's ``line`` names it)."""
    shown = reason if reason.startswith(f"line {line}") else f"line {line}: {reason}"
    warn(f"{run.jobs_path} {shown} (recorded as an error for id {show_value(job_id)})")
    run.out.write(error_record(job_id, reason, line))
    bar.update(1)


def _run(cluster, run: JobRun, batch_size: int) -> int:
    pending: List[Job] = []
    bar = tqdm(total=len(run.entries), initial=0, unit="job", desc="jobs", file=sys.stderr, dynamic_ncols=True)
    for entry in run.entries:
        if entry.id in run.done:
            bar.update(1)
        elif isinstance(entry, BadLine):
            _record_error(run, entry.id, entry.reason, entry.line, bar)
        else:
            pending.append(entry)
    vocab = cluster.engine.vocab_size
    tokens, tic = 0, time.perf_counter()
    key = lambda j: repr(j.sampling_key())  # noqa: E731
    for _, group in groupby(sorted(pending, key=key), key=key):
        group = list(group)
        size = 1 if cluster.engine.options.draft_model or group[0].sampling.get("prompt_lookup_ngram") else batch_size
        for start in range(0, len(group), size):  # speculative decoding runs one prompt at a time
            batch = _runnable(cluster, run, group[start : start + size], vocab, bar)
            tokens += _generate(cluster, run, batch, bar)
            if batch:
                bar.set_postfix_str(f"{tokens / (time.perf_counter() - tic):.1f} tok/s")
    bar.close()
    return 0


def _generate(cluster, run: JobRun, batch: List[Job], bar) -> int:
    """Generate ``batch`` and write its records; returns the tokens made. A
    ``UserError`` from the cluster (raised on rank 0 before anything runs)
    or ``GenerationFailed`` (the generation failed on every rank alike)
    splits the batch into single jobs, and a single job's becomes its error
    record; one raised by a lost rank ends the run, as before."""
    if not batch:
        return 0
    lost = len(cluster.world.lost)
    t0 = time.perf_counter()
    try:
        results = cluster.generate_batch(
            [run.prompt_of(cluster, j) for j in batch], **batch[0].sampling
        )
    except (UserError, GenerationFailed) as e:  # GenerationFailed: it failed on every rank alike
        if len(cluster.world.lost) > lost:
            raise
        if len(batch) > 1:
            return sum(_generate(cluster, run, [job], bar) for job in batch)
        _record_error(run, batch[0].id, f"line {batch[0].line}: {one_line(e)}", batch[0].line, bar)
        return 0
    elapsed = time.perf_counter() - t0
    tokens = 0
    for job, result in zip(batch, results):
        record = {
            "id": job.id,
            "text": result.text,
            "tokens": result.tokens,
            "prompt_tokens": result.stats.get("prompt_tokens"),
            "generation_tps": result.stats.get("generation_tps"),
            "batch_size": len(batch),
            "elapsed_s": round(elapsed, 4),
        }
        if result.stats.get("draft_tokens"):  # speculative decoding
            record.update({k: result.stats[k] for k in
                           ("draft_tokens", "draft_tokens_accepted", "acceptance", "tokens_per_forward",
                            "num_draft_tokens")})
        run.out.write(record)
        tokens += len(result.tokens)
    bar.update(len(batch))
    return tokens


def _runnable(cluster, run: JobRun, jobs: List[Job], vocab: Optional[int], bar) -> List[Job]:
    """The jobs whose prompt and parameters pass every check rank 0 can make
    (the vocabulary bound on top_k, the tokenizer, the context); the rest
    become error records."""
    ok = []
    for job in jobs:
        top_k = job.sampling.get("top_k", 0)
        if vocab is not None and is_integer(top_k) and top_k >= vocab:
            _record_error(run, job.id, f"line {job.line}: top_k must be below the vocabulary size ({vocab}), "
                                       f"got {top_k}", job.line, bar)
            continue
        try:
            prompt = run.prompt_of(cluster, job)
            ids = cluster.encode(messages=prompt) if isinstance(prompt, list) else cluster.encode(prompt)
        except Exception as e:  # the tokenizer or its chat template, on rank 0 alone: nothing broadcast
            _record_error(run, job.id, f"line {job.line}: {one_line(e)}", job.line, bar)
            continue
        try:
            cluster.request([ids], **job.sampling)
        except (UserError, TypeError, ValueError) as e:
            _record_error(run, job.id, f"line {job.line}: {one_line(e)}", job.line, bar)
            continue
        ok.append(job)
    return ok
