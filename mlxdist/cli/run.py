"""Entry point: ``mpirun -np N python -m mlxdist.run --model M -p PROMPT``.

Rank 0 runs the command loop (LOAD, then GENERATE per prompt, SHUTDOWN)
through ``Cluster``; every other rank serves until SHUTDOWN. Errors in the
user's input end the job with one line on rank 0 and a non-zero exit on every
rank; an unexpected error aborts the whole MPI job. Options follow
``mlx_lm.generate`` where both have them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, List, Optional, TextIO, Tuple

import mlx.core as mx

from mlxdist import envs
from mlxdist.config import (
    AUTO_SPLIT, AUTO_WIDTH, DEFAULT_MAX_TOKENS, EXPERT_SPLITS, KV_RESERVE_TOKENS, REPLICATE, GenerationParams,
    kv_reserve_tokens_arg,
)
from mlxdist.inputs.digits import arg_duration, arg_int, arg_int_or, arg_number
from mlxdist.dispatch import DISPATCH_MODES, LAYOUTS, modes
from mlxdist.errors import GenerationFailed, UserError, say_error
from mlxdist.model.budgets import parse_rank_memory
from mlxdist.values.placement import Placement
from mlxdist.runtime.heartbeat import FROM_ENVIRONMENT, arg_heartbeat
from mlxdist.runtime.progress import set_quiet
from mlxdist.runtime.watchdog import DEFAULT_TIMEOUT
from mlxdist.runtime.world import BACKENDS, join
from mlxdist.runtime.exits import run_or_abort, set_exit_code
from mlxdist.runtime.launcher import launch_fifo, launcher_rank

if TYPE_CHECKING:
    from mlxdist.api import Cluster
    from mlxdist.cli.jobs import JobRun


def build_parser() -> argparse.ArgumentParser:
    """The command line, in groups as ``mlx_lm.server``'s help reads: the
    model, the prompt (and job files), sampling, speculative decoding, how the
    model is spread over the ranks, memory, output, the job."""
    p = RankZeroParser(prog="python -m mlxdist.run", description=__doc__.splitlines()[0],
                       usage="mpirun -np N python -m mlxdist.run [--model M] [-p PROMPT] [options]")
    model_opts = p.add_argument_group("model")
    model_opts.add_argument("--model", help="model folder or hub id (default: a small built-in random MoE)")
    model_opts.add_argument("--revision", help="a hub id's branch, tag or commit (default: main)")

    prompt_opts = p.add_argument_group("prompt")
    prompt_opts.add_argument("-p", "--prompt",
                             help="one prompt ('-': all of stdin, as mlx_lm.generate); without it, rank 0 reads one "
                                  "prompt per line from stdin")
    prompt_opts.add_argument("--system-prompt", help="system message for the chat template")
    prompt_opts.add_argument("--ignore-chat-template", action="store_true",
                             help="use the raw prompt (-p, stdin and job-file prompt lines), not the tokenizer's "
                                  "chat template")
    prompt_opts.add_argument("--jobs", help="JSONL job file (one {id, prompt|messages, ...} per line)")
    prompt_opts.add_argument("--out", help="JSONL results file for --jobs (appended, one run at a time; a rerun "
                                           "resumes)")
    prompt_opts.add_argument("--batch-size", type=arg_int(), default=8, help="jobs decoded together with --jobs")
    prompt_opts.add_argument("--retry-errors", action="store_true",
                             help="with --jobs: run again the jobs whose only record in --out is an error record "
                                  "(without it, error records count as finished)")

    sampling_opts = p.add_argument_group("sampling")
    sampling_opts.add_argument("-m", "--max-tokens", type=arg_int(), default=DEFAULT_MAX_TOKENS,
                               help="tokens to generate at most (default %(default)s)")
    sampling_opts.add_argument("--temp", type=arg_number(), default=0.0,
                               help="sampling temperature; 0: greedy (default %(default)s)")
    sampling_opts.add_argument("--top-p", type=arg_number(), default=1.0,
                               help="nucleus sampling threshold (default %(default)s)")
    sampling_opts.add_argument("--top-k", type=arg_int(), default=0,
                               help="sample from the k likeliest tokens; 0: all (default %(default)s)")
    sampling_opts.add_argument("--min-p", type=arg_number(), default=0.0,
                               help="minimum probability relative to the likeliest token (default %(default)s)")
    sampling_opts.add_argument("--seed", type=arg_int(), default=None,
                               help="random seed of the sampler (default: one drawn on rank 0 for each generation, "
                                    "shared with every rank)")
    sampling_opts.add_argument("--max-kv-size", type=arg_int(), default=None,
                               help="rotating KV cache of this many tokens")
    sampling_opts.add_argument("--prefill-step-size", type=arg_int(), default=2048,
                               help="prompt tokens per prefill step (default %(default)s)")

    speculative_opts = p.add_argument_group("speculative decoding")
    speculative_opts.add_argument("--draft-model", default=None,
                                  help="a small model with the same tokenizer drafts tokens that the distributed "
                                       "model verifies, several per forward (one prompt at a time)")
    speculative_opts.add_argument("--num-draft-tokens", type=arg_int_or(AUTO_WIDTH, 1), default=AUTO_WIDTH,
                                  metavar="K|auto",
                                  help="tokens drafted per verifying forward, or auto: per prompt, the width with "
                                       "the most tokens a second by what the earlier prompts measured (3 for the "
                                       "first; docs/modes.md) (default %(default)s)")
    speculative_opts.add_argument("--prompt-lookup-ngram", type=arg_int(), default=0, metavar="N",
                                  help="without a draft model: draft the tokens that followed the last N tokens "
                                       "where they occurred before in the prompt or output (default 0: off)")

    distribution_opts = p.add_argument_group("distribution", "how the model is spread over the ranks (docs/modes.md)")
    distribution_opts.add_argument("--mode", "--dispatch", choices=DISPATCH_MODES, default="auto",
                                   help=f"{modes.help_text()} (default %(default)s; docs/modes.md; --dispatch: its "
                                        f"old name, kept for one release)")
    distribution_opts.add_argument("--backend", choices=BACKENDS, default=None,
                                   help="MLX's transport for arrays: mpi, nccl (CUDA), ring (TCP), jaccl or "
                                        "jaccl-ring (RDMA over Thunderbolt, every pair or neighbours cabled); "
                                        "default: the one mlx.launch started, else nccl on CUDA, else mpi")
    distribution_opts.add_argument("--layout", choices=LAYOUTS, default=None,
                                   help="collective modes: masked (static shapes) or compact (owned slots only, "
                                        "host read-back); default: compact on the CPU, masked on GPUs")
    distribution_opts.add_argument("--expert-split", choices=EXPERT_SPLITS, default=AUTO_SPLIT,
                                   help="whole: each expert on one rank (exact modes); width: every expert cut over "
                                        "the ranks as tensor parallelism cuts them (balanced, not bit-exact; every "
                                        "mode but p2p); auto (the default): under --mode auto, the cut auto "
                                        "weighs cheaper from what the ranks measure at load, where nothing needs "
                                        "whole experts (see docs/modes.md); else whole")
    distribution_opts.add_argument("--replicate", choices=REPLICATE, default="auto",
                                   help="--mode auto: every rank holds every expert, and batches of a sequence "
                                        "per rank or more run as N replicas with no exchange; auto: where every "
                                        "host has room for the whole model per rank it runs and nothing else says "
                                        "where experts go (default %(default)s)")
    distribution_opts.add_argument("--exact", action="store_true",
                                   help="every batch bit-exact (single-process mlx-lm's logits): auto runs collective "
                                        "with whole experts for every batch; collective and p2p are exact already")
    distribution_opts.add_argument("--remeasure", action="store_true",
                                   help="auto: measure the link and the dense work and decide again, not the decision "
                                        "stored at the first load of this model on these hosts (docs/modes.md)")
    distribution_opts.add_argument("--placement", help="placement JSON file (default: experts spread evenly)")
    distribution_opts.add_argument("--save-placement", help="write the placement used to this JSON file")
    distribution_opts.add_argument("--no-rank0-experts", action="store_true", help="rank 0 holds no experts")

    memory_opts = p.add_argument_group("memory", "what each rank keeps resident (docs/memory.md)")
    memory_opts.add_argument("--rank-memory", metavar="HOST=GB,...|A,B,...", type=rank_memory_later, default=None,
                             help="GB of expert weights each host (matched by name, split evenly over its ranks; or "
                                  "a JSON hostfile with memory_gb) or each rank (in order) may keep resident: "
                                  "experts are spread in proportion, and a placement that does not fit is refused "
                                  "(default: from the memory each rank finds)")
    memory_opts.add_argument("--expert-capacity", type=arg_int(), default=None,
                             help="experts each rank keeps resident per layer; the rest are read from its "
                                  "checkpoint copy on demand into least-recently-used slots (needs --layout compact "
                                  "or --mode p2p)")
    memory_opts.add_argument("--memory-budget", type=arg_number(above=0), default=None, metavar="GB",
                             help="weights each rank may hold, in GB: sets its expert capacity from what its dense "
                                  "weights leave (as --expert-capacity, which it replaces)")
    memory_opts.add_argument("--kv-reserve-tokens", type=kv_reserve_tokens_arg, default=KV_RESERVE_TOKENS,
                             metavar="N",
                             help="KV-cache tokens each rank that runs attention keeps room for, at the model's own "
                                  "cache size per token (default %(default)s)")

    output_opts = p.add_argument_group("output")
    output_opts.add_argument("--verbose", type=_str2bool, nargs="?", const=True, default=None,
                             metavar="True|False",
                             help="by default the text, then one summary line on stderr; --verbose (or True): also "
                                  "how auto spread the model and what it measured; --verbose False (as "
                                  "mlx_lm.generate): the text alone")
    output_opts.add_argument("--quiet", action="store_true", help="no progress lines while the model loads")
    output_opts.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    output_opts.add_argument("--stats", action="store_true", help="count routed slots per expert (printed with --json)")
    output_opts.add_argument("--record-routing", metavar="FILE",
                             help="write the job's routed slots per (layer, expert) to FILE at exit (python -m "
                                  "mlxdist.place reads it; docs/placement.md)")
    output_opts.add_argument("--logprobs-out", help="save each step's log-probabilities (.npy) for checks")

    job_opts = p.add_argument_group("job")
    job_opts.add_argument("--timeout", type=arg_duration(), default=DEFAULT_TIMEOUT,
                          help="seconds without progress before a generation is declared hung (default %(default)s)")
    job_opts.add_argument("--heartbeat", type=arg_heartbeat, default=FROM_ENVIRONMENT, metavar="SECONDS",
                          help="seconds a rank may send no heartbeat before it is lost and the job ends with one "
                               "line naming it and its host (default: MLXDIST_HEARTBEAT, else 5; off: none; docs/failures.md)")
    add_host_flags(job_opts)
    return p


class RankZeroParser(argparse.ArgumentParser):
    """argparse whose errors are printed by rank 0 alone (every rank parses the
    same command line); the other ranks exit quietly and rank 0 gives the job
    its status (were another rank to fail first, mpirun could stop rank 0
    before it said why)."""

    def error(self, message: str):
        if launcher_rank() != 0:
            self.exit(0)
        super().error(message)


def add_host_flags(p) -> None:
    """--trust-remote-code and --allow-sleep (the run and the server), on
    ``p``: a parser or one of its argument groups."""
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the model repository's own tokenizer code (Kimi K2 needs it); off by default, see "
                        "docs/SECURITY.md")
    p.add_argument("--allow-sleep", action="store_true",
                   help="macOS: let the Macs sleep during the job (by default each rank holds caffeinate -i)")


def apply_host_flags(args) -> None:
    """The flags of ``add_host_flags`` as the environment every rank reads (envs.py)."""
    if args.trust_remote_code:
        envs.put("MLXDIST_TRUST_REMOTE_CODE", 1)
    if args.allow_sleep:
        envs.put("MLXDIST_ALLOW_SLEEP", 1)


def rank_memory_arg(text: str):
    """``--rank-memory`` (here and in ``mlxdist.serve``): GB per host name
    (HOST=GB,... or a JSON hostfile) or per rank (A,B,...), as
    ``budgets.parse_rank_memory`` reads them."""
    try:
        return parse_rank_memory(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@dataclass(frozen=True)
class RankMemoryFile:
    """``--rank-memory``'s JSON hostfile as the command line names it, read
    by rank 0 alone once the job has started (``read_rank_memory``): it may
    exist on rank 0's host only, and a rank that could not read it must not
    leave the others waiting for it in MPI's start."""

    path: str


def rank_memory_later(text: str):
    """``--rank-memory`` of the run and the server: ``rank_memory_arg``,
    but a JSON hostfile is only named here (``RankMemoryFile``)."""
    return RankMemoryFile(text) if text.endswith(".json") else rank_memory_arg(text)


def read_rank_memory(value):
    """``--rank-memory``'s budgets, its hostfile read now (rank 0, after
    ``join``); PlacementError for a hostfile that gives none."""
    return parse_rank_memory(value.path) if isinstance(value, RankMemoryFile) else value


def _str2bool(text: str) -> bool:
    """mlx_lm.generate's reading of --verbose."""
    if text.lower() in ("true", "t", "1", "yes"):
        return True
    if text.lower() in ("false", "f", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, not {text!r}")


def generation_args(args) -> dict:
    """The command line's ``GenerationParams`` fields."""
    return dict(
        max_tokens=args.max_tokens,
        temp=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        prefill_step_size=args.prefill_step_size,
        max_kv_size=args.max_kv_size,
        num_draft_tokens=args.num_draft_tokens,
        prompt_lookup_ngram=args.prompt_lookup_ngram,
    )


def _stdin():
    """Rank 0's standard input: the FIFO ``launch/mpirun`` hands it, where
    set, since Open MPI 5 forwards stdin lines to rank 0 but never their EOF
    (with plain mpirun, end the input with a line reading /exit)."""
    path = envs.get("MLXDIST_STDIN")
    return open(path) if path else sys.stdin


def _stdout() -> TextIO:
    """Rank 0's standard output: the FIFO ``launch/mpirun`` passes on as it
    comes, where set and read on this host, since Open MPI 5 forwards a rank's
    output a line at a time (a streamed answer would show as its lines end)."""
    fd = launch_fifo("MLXDIST_STDOUT")
    if fd is None:
        return sys.stdout
    os.set_blocking(fd, True)
    return open(fd, "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors)


def _prompts(args) -> Iterator[str]:
    """--prompt, or one prompt per line of stdin until EOF or /exit."""
    if args.prompt == "-":  # mlx_lm.generate's habit: the prompt is all of stdin
        yield _stdin().read()
        return
    if args.prompt is not None:
        yield args.prompt.replace("\\n", "\n").replace("\\t", "\t")
        return
    for line in _stdin():
        line = line.rstrip("\n")
        if line.strip() == "/exit":
            return
        if line.strip():
            yield line


def encode_prompt(cluster: Cluster, args, text: str) -> List[int]:
    """As ``mlx_lm.generate``: the chat template where the tokenizer has one
    (with ``--system-prompt``), unless ``--ignore-chat-template``."""
    if args.ignore_chat_template or not cluster.engine.tokenizer.has_chat_template:
        return cluster.encode(text)
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
    return cluster.encode(messages=[*messages, {"role": "user", "content": text}])


def _summary(stats: dict, tokens: int) -> str:
    peaks = ", ".join(f"{p:.3f}" for p in stats["peak_memory_gb"])
    return (
        f"prompt: {stats.get('prompt_tokens', 0)} tokens, {stats.get('prompt_tps', 0.0):.1f} tok/s | "
        f"generation: {tokens} tokens, {stats.get('generation_tps', 0.0):.1f} tok/s | "
        + (f"drafted {stats['draft_tokens']} ({stats['num_draft_tokens']} a forward), "
           f"kept {stats['draft_tokens_accepted']} ({stats['acceptance']:.0%}), "
           f"{stats['tokens_per_forward']:.2f} tokens per forward | " if stats.get("draft_tokens") else "") +
        f"peak memory (GB) per rank: [{peaks}]"
    )


def _run_prompt(cluster: Cluster, args, text: str, logprobs: List) -> None:
    stats: dict = {}
    tokens, pieces = [], []
    request = cluster.request([encode_prompt(cluster, args, text)], **generation_args(args))
    for piece in cluster.stream(request, stats):
        tokens.append(piece.token)
        pieces.append(piece.text)
        if args.logprobs_out:
            logprobs.append(piece.logprobs)
        if not args.json:
            print(piece.text, end="", flush=True)
    if args.json:
        engine = cluster.engine
        record = {
            "text": "".join(pieces),
            "tokens": tokens,
            "prompt_tokens": stats.get("prompt_tokens", 0),
            "prompt_tps": stats.get("prompt_tps", 0.0),
            "generation_tps": stats.get("generation_tps", 0.0),
            "finish_reason": stats.get("finish_reason"),
            "draft_tokens": stats.get("draft_tokens", 0),
            "draft_tokens_accepted": stats.get("draft_tokens_accepted", 0),
            "acceptance": stats.get("acceptance"),
            "tokens_per_forward": stats.get("tokens_per_forward", 1.0),
            "num_draft_tokens": stats.get("num_draft_tokens", 0),
            "peak_memory_gb": stats["peak_memory_gb"],
            "weights_gb": [{k.replace("_bytes", ""): v / 1e9 for k, v in m.items()} for m in engine.memory_by_rank],
            "mode": engine.options.mode,
            "dispatch": engine.options.mode,  # the old name of "mode", kept for one release
            "expert_split": engine.options.expert_split,  # the cut taken (auto chooses one at load)
            "auto_decision": engine.decision.report() if engine.decision is not None else None,  # docs/modes.md
            "num_ranks": cluster.world.size,
        }
        if cluster.world.lost:
            record["lost_ranks"] = cluster.world.lost
        if args.stats:
            record["expert_load"] = stats["exchange"]["expert_load"]
        print(json.dumps(record), flush=True)
    else:
        print(flush=True)
        if args.verbose is not False:  # None, the default: the summary line; False: the text alone
            if stats.get("verify_width"):
                print(stats["verify_width"], file=sys.stderr, flush=True)
            print(_summary(stats, len(tokens)), file=sys.stderr, flush=True)


def _explain_auto(engine) -> None:
    """--verbose under auto: how the experts were cut, whether every rank
    holds every expert, what it measured at load, then each choice where it
    changes, with every candidate's estimated step."""
    if engine.split is not None:
        print(engine.split.describe(), file=sys.stderr, flush=True)
    if engine.runs_replicas:
        print(f"auto: every rank holds every expert (--replicate {engine.options.replicate}): batches of "
              f"{engine.world.size} or more run as replicas", file=sys.stderr, flush=True)
    if engine.auto_inputs is None:
        return
    print(f"auto: {engine.auto_inputs.describe()}", file=sys.stderr, flush=True)
    decision = engine.decision
    if decision is not None and decision.source != "fixed":
        where = decision.file or "not stored"
        print(f"auto: decision {decision.source} ({where}; --remeasure decides again)", file=sys.stderr, flush=True)
    engine.on_choice = lambda choice: print(choice.describe(), file=sys.stderr, flush=True)


@dataclass
class Inputs:
    """What rank 0 reads and checks before the model code is imported."""

    placement: Optional[Placement] = None  # --placement, read and checked against the world's size
    jobs: Optional[JobRun] = None  # --jobs, read and checked, with --out locked


def check_inputs(args, num_ranks: int) -> Tuple[int, Inputs]:
    """Rank 0, before mlx-lm is imported: the generation flags, the
    placement file, --rank-memory's hostfile and the job file (read,
    checked, --out locked; each may exist on rank 0's host alone), so that
    a refused input costs seconds less and nothing is loaded. Returns the
    exit status (0: go on) and what was read."""
    try:
        GenerationParams(**{**generation_args(args), "seed": 0}).validate()
        args.rank_memory = read_rank_memory(args.rank_memory)
        placement = Placement.load(args.placement) if args.placement else None
        if placement is not None:
            placement.check_world(num_ranks)
    except UserError as e:
        say_error(str(e))
        return 1, Inputs()
    jobs = None
    if args.jobs:
        from mlxdist.cli.jobs import INPUT_ERROR, open_jobs

        try:
            jobs = open_jobs(args.jobs, args.out, generation_args(args), args.retry_errors,
                             templated=not args.ignore_chat_template, system_prompt=args.system_prompt)
        except UserError as e:
            say_error(str(e))
            return INPUT_ERROR, Inputs()
    return 0, Inputs(placement, jobs)


def command_loop(cluster: Cluster, args, inputs: Inputs) -> int:
    """Rank 0: LOAD, then GENERATE each prompt (or the job file)."""
    sys.stdout = _stdout()
    jobs = inputs.jobs
    try:
        cluster.load(args.model, mode=args.mode, placement=inputs.placement,
                     rank0_experts=not args.no_rank0_experts, layout=args.layout, stats=args.stats,
                     expert_capacity=args.expert_capacity, memory_budget_gb=args.memory_budget,
                     expert_split=args.expert_split, record_routing=args.record_routing,
                     rank_memory_gb=args.rank_memory, draft_model=args.draft_model, revision=args.revision,
                     replicate=args.replicate, exact=args.exact, remeasure=args.remeasure,
                     kv_reserve_tokens=args.kv_reserve_tokens)
    except UserError as e:
        say_error(str(e))
        if jobs is not None:
            jobs.close()
        return 1
    if args.verbose:
        _explain_auto(cluster.engine)
    if args.save_placement:
        cluster.engine.placement.save(args.save_placement)
    if jobs is not None:
        from mlxdist.cli.jobs import run_jobs

        return run_jobs(cluster, jobs, batch_size=args.batch_size)
    logprobs: List = []
    for text in _prompts(args):
        try:
            _run_prompt(cluster, args, text, logprobs)
        except (UserError, GenerationFailed) as e:  # GenerationFailed: on every rank alike, the job goes on
            say_error(str(e))
            if args.prompt is not None:
                return 1
    if args.logprobs_out:
        import numpy as np

        np.save(args.logprobs_out, np.stack([np.array(l.astype(mx.float32)) for l in logprobs]))  # bf16: exact in f32
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """The ``mlxdist-run`` console script and ``python -m mlxdist.run``:
    the command line, then joining the job and rank 0's checks of its input
    (before mlx-lm's imports, which take seconds), then ``api.init`` (ranks
    other than 0 serve there and exit), then rank 0's command loop."""
    args = build_parser().parse_args(argv)
    if args.jobs and not args.out:
        build_parser().error("--jobs needs --out")
    apply_host_flags(args)
    set_quiet(args.quiet)
    world = join(args.backend)
    code, inputs = run_or_abort(world, check_inputs, args, world.size) if world.is_root else (0, None)
    code = int(world.control.bcast_bytes(str(code).encode() if world.is_root else None))  # rank 0's, on every rank
    if code:
        set_exit_code(code)
        return code
    from mlxdist.api import init  # mlx-lm and transformers: seconds, so only once the input is good

    # a lost rank ends the job with the heartbeat's line, as supervise reads it
    cluster = init(timeout=args.timeout, backend=args.backend, heartbeat=args.heartbeat, raise_rank_lost=False)
    code = run_or_abort(cluster.world, command_loop, cluster, args, inputs)
    cluster.shutdown(code)
    set_exit_code(code)  # the status the process ends with (runtime/world.py finalizes and exits)
    return code


if __name__ == "__main__":
    sys.exit(main())
