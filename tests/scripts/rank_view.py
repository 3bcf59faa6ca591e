"""Run a command as one rank of a job that sees its own file system: on the
ranks listed (default: every rank but 0) in a mount namespace of its own
(``unshare -m``) where each --hide folder is an empty tmpfs (of --hide-size bytes), and
each --bind SRC DST shows SRC at DST, each --read-only DIR is read-only, and with --hostname-prefix P the
rank's host name is P<rank> (a UTS namespace, ``unshare -u``); every rank gets MLXDIST_CACHE=<--cache>/rank<r>,
as if each rank were a machine of its own.

    python rank_view.py [--hide DIR [--hide-size N]] [--bind SRC DST] [--read-only DIR] [--cache ROOT] [--ranks 1,2] -- CMD ...
"""

import argparse
import os
import shlex
import sys

p = argparse.ArgumentParser()
p.add_argument("--hide", action="append", default=[])
p.add_argument("--hide-size", default=None)
p.add_argument("--bind", nargs=2, action="append", default=[])
p.add_argument("--read-only", action="append", default=[])
p.add_argument("--cache")
p.add_argument("--hostname-prefix")
p.add_argument("--ranks", default=None)
p.add_argument("cmd", nargs=argparse.REMAINDER)
args = p.parse_args()
cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("MLX_RANK", "0")))
if args.cache:
    os.environ["MLXDIST_CACHE"] = os.path.join(args.cache, f"rank{rank}")
ranks = {int(r) for r in args.ranks.split(",")} if args.ranks else None
if (rank in ranks) if ranks is not None else rank != 0:
    size = f"-o size={args.hide_size} " if args.hide_size else ""
    mounts = [f"mkdir -p {shlex.quote(d)} && mount -t tmpfs {size}none {shlex.quote(d)}" for d in args.hide]
    mounts += [f"mount --bind {shlex.quote(s)} {shlex.quote(d)}" for s, d in args.bind]
    mounts += [f"mount --bind {shlex.quote(d)} {shlex.quote(d)} && mount -o remount,bind,ro {shlex.quote(d)}"
               for d in args.read_only]
    if args.hostname_prefix:
        mounts.append(f"hostname {shlex.quote(args.hostname_prefix)}{rank}")
    script = " && ".join(mounts + ['exec "$@"'])
    os.execvp("unshare", ["unshare", "-m", "-u", "sh", "-c", script, "sh", *cmd])
os.execvp(cmd[0], cmd)
