"""What every rank does with each command. Rank 0 calls these through
``Cluster`` right after broadcasting the command; the other ranks call them
from ``serve`` in the same order, so every collective lines up.

A command's outcome is every rank's: its own work failing on one rank is
carried on the reports the ranks gather anyway and raised on every rank
(``_gathered``), and a generation that fails on one rank is agreed or ends
the job (``runtime/agreement.py``). Either way no rank is left waiting.
"""

import gc
import json
import os
from typing import Any, Callable, Dict, Iterator, List, Optional

import mlx.core as mx

from mlxdist.runtime import control as commands
from mlxdist.runtime.control import Command
from mlxdist.config import (
    GenerateCommand, LoadCommand, PlaceCommand, ProbeCommand, ServeCommand, ShutdownCommand, StatsCommand,
)
from mlxdist.dispatch.stats import routing_share
from mlxdist.engine import Engine, load_engine
from mlxdist.errors import (
    GenerationFailed, LoadError, MlxdistError, StepFailed, UserError, keep_traceback, one_line,
)
from mlxdist.ship.fingerprint import differing_files
from mlxdist.values.placement import Placement
from mlxdist.ship.unreceived import explain
from mlxdist.runtime import faults
from mlxdist.runtime.agreement import agree, failed_together
from mlxdist.runtime.world import World
from mlxdist.runtime.watchdog import ACTIVITY


_FINGERPRINT_NAMES = {
    "mlxdist": "mlxdist version",
    "protocol": "control protocol",
    "options": "load options",
    "files": "checkpoint file",
    "revision": "hub revision",
    "placement": "placement",
    "libraries": "MLX / mlx-lm versions",
    "device": "backend or device",
}


def describe_mismatch(fingerprints: List[Dict[str, Any]]) -> Optional[str]:
    """None if every rank loaded the same thing; else one line naming the
    ranks that differ from rank 0 and in what."""
    ref = fingerprints[0]
    differ = {r: [k for k in ref if f.get(k) != ref[k]] for r, f in enumerate(fingerprints)}
    differ = {r: keys for r, keys in differ.items() if keys}
    if not differ:
        return None
    parts = [f"rank {r} ({', '.join(_differences(ref, fingerprints[r], keys))})" for r, keys in sorted(differ.items())]
    return "ranks loaded different things than rank 0: " + "; ".join(parts)


def _differences(ref: Dict[str, Any], other: Dict[str, Any], keys: List[str]) -> List[str]:
    """What ``other`` differs from ``ref`` in, by name; a checkpoint file by its own name."""
    out = []
    for key in keys:
        if key == "files" and isinstance(other.get(key), dict):
            out += [f"checkpoint file {name}" for name in differing_files(ref[key], other[key])]
        else:
            out.append(_FINGERPRINT_NAMES.get(key, key))
    return out


def _resident_bytes() -> int:
    """This process's resident set size now (not its peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # macOS: no /proc; the peak is the best we have
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# A probe runs on every rank at once (PROBE command) and returns a JSON-able
# answer; tools such as the benchmark register theirs at import, on every rank.
Probe = Callable[["CommandExecutor", Dict[str, Any]], Any]
PROBES: Dict[str, Probe] = {}


def register_probe(name: str) -> Callable[[Probe], Probe]:
    """Decorator: make ``fn(executor, args)`` callable as ``Cluster.probe(name, **args)``."""

    def register(fn: Probe) -> Probe:
        PROBES[name] = fn
        return fn

    return register


class CommandExecutor:
    """Carries out rank 0's commands on one rank (rank 0 included): holds
    the world and the loaded engine, if any."""

    def __init__(self, world: World):
        self.world = world
        self.engine: Optional[Engine] = None
        world.on_loss.append(self._adopt)

    def _adopt(self, lost: List[int]) -> None:
        if self.engine is not None:
            self.engine.adopt(lost)
            ACTIVITY.progress()

    def load(self, command: LoadCommand) -> Engine:
        """LOAD on every rank; raises ``LoadError`` on every rank if any
        failed. A failure the ranks agreed on inside the load (``agree``)
        ends it on every rank at once; one of this rank's own is sent at the
        load's last agreement, which meets the others at whichever agreement
        they are in."""
        self.unload()
        engine, error = None, None
        try:
            engine = load_engine(self.world, command.options)
            if self.world.lost:
                engine.adopt(self.world.lost)
        except StepFailed as e:  # every rank raised it at the same agreement
            raise LoadError(str(e)) from None
        except Exception as e:  # a corrupt file fails deep inside mlx or tokenizers
            e = explain(e)  # a read of bytes a share was not sent
            error = one_line(e)
            if not isinstance(e, MlxdistError):
                path = keep_traceback(self.world.rank)
                error += f" (traceback: {path})" if path else ""
        reports = agree(self.world, engine and {"memory": engine.memory, "fingerprint": engine.fingerprint},
                           error, raises=LoadError)
        mismatch = describe_mismatch([r["fingerprint"] for r in reports])
        if mismatch:
            raise LoadError(mismatch)
        engine.memory_by_rank = [r["memory"] for r in reports]
        self.engine = engine
        return engine

    def unload(self) -> None:
        """Drop the loaded model and give its memory back."""
        self.engine = None
        gc.collect()
        mx.clear_cache()

    def generate(self, command: GenerateCommand) -> Iterator[Any]:
        """GENERATE on every rank. Yields mlx-lm's responses on ranks that run
        the dense model (a stream for one prompt, one batch response for
        several or where ``batch`` is set); p2p workers serve experts and
        yield nothing, as do the other ranks where one prompt runs as a
        replica (rank 0 alone: ``auto`` over a dear link, every rank holding
        the model)."""
        engine = self.engine
        params = command.sampling
        mx.reset_peak_memory()
        engine.kv_bytes = None
        ACTIVITY.step, ACTIVITY.prefill, ACTIVITY.armed = 0, True, True
        ACTIVITY.progress()
        ACTIVITY.at("dense")
        alone = False  # one prompt that rank 0 runs by itself: no other rank is in its steps
        try:
            if not engine.runs_dense:
                engine.serve()
            elif len(command.prompts) == 1 and not command.batch:
                # a mode with no exchange (replicas): every rank holds the model, rank 0 runs it alone
                alone = not engine.dispatchers[engine.mode_for(1)].exchanges
                if alone and not self.world.is_root:
                    ACTIVITY.at("serving")
                else:
                    yield from self._stream(engine.generate(command.prompts[0], params),
                                            not engine.root_runs_dense and not alone)
            else:
                yield engine.generate_batch(command.prompts, params, command.mode)
        except StepFailed as e:  # agreed where the ranks met (replicas' gather): every rank raised it
            raise GenerationFailed(str(e)) from None
        except Exception as e:
            if self.world.size == 1:
                raise
            if alone:  # the others wait at the generation's end, where rank 0 meets them
                if isinstance(e, MlxdistError):
                    raise
                raise GenerationFailed(f"generation failed: {one_line(e)}") from None
            agreed = failed_together(self.world, e)  # or the job ends here
            if isinstance(e, MlxdistError):
                raise
            raise GenerationFailed(f"generation failed: {agreed}") from None
        finally:
            ACTIVITY.armed = False
            ACTIVITY.at("idle")

    def _stream(self, responses: Iterator[Any], lockstep: bool) -> Iterator[Any]:
        """One prompt's responses, token by token. Where every rank runs the
        generation (``lockstep``: not p2p, whose workers rank 0 releases
        itself), after each token that is not the last rank 0 tells the
        others on the control communicator whether its reader wants more:
        a stream abandoned early stops on every rank at the same token (the
        step mlx-lm keeps in flight runs everywhere, and is dropped)."""
        world = self.world
        for response in responses:
            ACTIVITY.progress()
            last = response.finish_reason is not None
            if world.size == 1 or last or not lockstep:
                yield response
                continue
            if world.is_root:
                try:
                    yield response
                except GeneratorExit:
                    world.control.bcast_flag(False)
                    responses.close()
                    raise
                world.control.bcast_flag(True)
            else:
                yield response
                phase = ACTIVITY.phase
                ACTIVITY.at("serving")  # waiting on rank 0's reader: not a hang
                more = world.control.bcast_flag(None)
                ACTIVITY.at(phase)
                if not more:
                    responses.close()
                    return

    def after_generation(self) -> List[Dict[str, Any]]:
        """Every rank's peak memory since the last GENERATE began, and its
        largest KV cache in it where known (dp), in bytes."""
        kv = self.engine.kv_bytes if self.engine is not None else None
        return self.world.control.allgather_json({"peak": mx.get_peak_memory(), "kv": kv})

    def stats(self, command: StatsCommand) -> List[Dict[str, Any]]:
        """STATS on every rank: each rank's counters, gathered everywhere.
        ``collect`` switches per-expert load counting on or off; ``reset``
        zeroes the counters after reading them."""
        return self._gathered("stats", lambda: self._own_stats(command))

    def _own_stats(self, command: StatsCommand) -> Dict[str, Any]:
        engine = self.engine
        mine: Dict[str, Any] = {
            "rank": self.world.rank,
            "active_memory_gb": mx.get_active_memory() / 1e9,
            "peak_memory_gb": mx.get_peak_memory() / 1e9,
            "rss_gb": _resident_bytes() / 1e9,
        }
        if engine is not None:
            counters = engine.dispatcher.stats
            mine.update(counters.as_dict())
            held = {str(l): o.owned_experts.tolist() for l, o in engine.ownership.items()}
            if not engine.root_runs_dense:  # every rank sees every slot: count its own
                total = sum(sum(c) for c in mine["expert_load"].values())
                mine["slots_local"] = sum(sum(c[e] for e in held[l]) for l, c in mine["expert_load"].items())
                mine["slots_remote"] = total - mine["slots_local"]
            mine["weights_gb"] = {k.replace("_bytes", ""): v / 1e9 for k, v in engine.memory.items()}
            if engine.paging is not None:
                mine["paging"] = engine.paging.as_dict()
                if command.reset:
                    engine.paging.reset()
            mine["experts_held"] = held
            mine["auto_decision"] = engine.decision.report() if engine.decision is not None else None  # rank 0's
            if command.routing:  # this rank's part of the job's routed slots (--record-routing)
                share = routing_share(engine.dispatchers.values(), self.world.rank)
                mine["routing"] = {str(l): c.tolist() for l, c in share.items()}
            if command.reset:
                counters.reset()
            if command.collect is not None:
                counters.collect_expert_load = command.collect
        return mine

    def _gathered(self, op: str, work: Callable[[], Any]) -> List[Any]:
        """Every rank's ``work()`` (JSON-able), gathered on every rank. Where
        it raised on any rank, ``StepFailed`` on every rank naming those
        ranks: they agree on the reports they exchange anyway, so none is
        left waiting and the job goes on."""
        value, error = None, None
        try:
            faults.point("command", self.world.rank, op=op)
            value = work()
            json.dumps(value)  # fails here, on this rank, rather than inside the gather
        except Exception as e:  # noqa: BLE001 - every rank hears of it below
            value, error = None, one_line(e)
        return agree(self.world, value, error, failed=f"{op} failed: ")

    def serve_http(self, command: ServeCommand) -> None:
        """SERVE on every rank: the OpenAI-compatible server (``serving/server.py``)."""
        from mlxdist.serving.server import serve

        serve(self, command.options)

    def place(self, command: PlaceCommand) -> List[float]:
        """PLACE on every rank: hold the given placement's experts from now
        on (``Engine.place``, all or nothing); each rank's seconds. Raises
        ``UserError`` on every rank, the old placement kept everywhere,
        where any rank refused or failed."""
        try:  # Engine.place agrees on every failure of its own; the plan was checked on rank 0
            seconds = self.engine.place(Placement.from_json(command.placement))
        except MlxdistError as e:  # the same on every rank: the ranks agree before anything changes
            raise UserError(f"place failed: {one_line(e)}") from None
        ACTIVITY.progress()
        return self.world.control.allgather_json(seconds)

    def probe(self, command: ProbeCommand) -> List[Any]:
        """PROBE on every rank: the registered probe's answer from each rank."""
        return self._gathered("probe", lambda: PROBES[command.name](self, command.args))

    def serve(self) -> int:
        """Ranks other than 0: follow rank 0's commands until SHUTDOWN."""
        while True:
            command = commands.broadcast(self.world)
            if isinstance(command, ShutdownCommand):
                ACTIVITY.at("exiting")
                return command.exit_code
            self.handle(command)

    def handle(self, command: Command) -> None:
        """One command on a rank other than 0 (rank 0's ``Cluster`` makes the same calls)."""
        if isinstance(command, LoadCommand):
            try:
                self.load(command)
            except LoadError:
                pass  # rank 0 reports it
        elif isinstance(command, GenerateCommand):
            try:
                for _ in self.generate(command):
                    pass
            except MlxdistError:
                pass  # every rank failed alike (agreed): rank 0 reports it
            self.after_generation()
        elif isinstance(command, ServeCommand):
            self.serve_http(command)
        else:
            try:
                {commands.STATS: self.stats, commands.PROBE: self.probe, commands.PLACE: self.place}[command.op](
                    command)
            except UserError:
                pass  # raised on every rank alike: rank 0 reports it
