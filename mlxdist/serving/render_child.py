"""The child process of ``templates.render``: one chat template rendered in
jinja2's ``ImmutableSandboxedEnvironment`` under a CPU rlimit and a memory
cap, its output cut at ``max_chars``. The memory cap is ``RLIMIT_AS`` on
Linux; macOS does not enforce that one (setting it below the address space
already mapped fails), so there the cap is ``RLIMIT_DATA`` where it can be
set and, always, a thread that ends the child once its resident memory
passes the cap. Reads the job as JSON on stdin,
writes ``{"text": ...}`` or ``{"error": ...}`` on stdout. Standard library
and jinja2 only: it runs as a file (``python -I render_child.py``), not as
part of the package.
"""

import json
import os
import resource
import sys
import threading
import time
from datetime import datetime


def _raise(message):
    raise ValueError(message)


def _cap_memory(limit: int) -> None:
    if sys.platform.startswith("linux"):
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        return
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    except (ValueError, OSError):
        pass
    per_kb = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KB elsewhere

    def watch():
        while True:
            if resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * per_kb > limit:
                sys.stdout.buffer.write(json.dumps({"error": "MemoryError: over the template memory cap"}).encode())
                sys.stdout.flush()
                os._exit(0)
            time.sleep(0.01)

    threading.Thread(target=watch, daemon=True).start()


def main() -> int:
    job = json.loads(sys.stdin.buffer.read())
    _cap_memory(job["memory"])
    resource.setrlimit(resource.RLIMIT_CPU, (job["cpu_seconds"], job["cpu_seconds"]))
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # What transformers gives a chat template (its apply_chat_template's environment).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: json.dumps(
        x, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        chunks, size = [], 0
        for chunk in env.from_string(job["template"]).generate(**job["variables"]):
            size += len(chunk)
            if size > job["max_chars"]:
                raise ValueError(f"it renders more than {job['max_chars']} characters")
            chunks.append(chunk)
        result = {"text": "".join(chunks)}
    except Exception as e:  # noqa: BLE001 - whatever the template did is its error (TemplateError, SecurityError, ...)
        result = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    sys.stdout.buffer.write(json.dumps(result).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
