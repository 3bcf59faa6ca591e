"""Unit tests: placement, control messages, the exchange's split/assemble
helpers, and reading expert rows straight from safetensors files."""

import json
import re

import mlx.core as mx
import numpy as np
import pytest

from mlxdist.runtime import control as commands
from mlxdist.config import GenerateCommand, GenerationParams
from mlxdist.runtime.control import ProtocolError
from mlxdist.dispatch import LayerOwnership
from mlxdist.dispatch.base import ExpertBatch
from mlxdist.model.experts import padded_slots, run_experts
from mlxdist.dispatch.wire import from_numpy, pack, to_numpy, unpack
from mlxdist.model.checkpoint import CheckpointError, read_rows
from mlxdist.ship.locate import read_safetensors_index
from mlxdist.runtime.world import find_libmpi
from mlxdist.values.placement import Placement, PlacementError, resolve_placement


def test_even_placement_spreads_contiguous_blocks():
    p = Placement.even({0: 12, 2: 12}, 4)
    assert p.layers[0] == [(r,) for r in [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]]
    assert p.experts_of(2, 1) == [3, 4, 5]
    p.validate({0: 12, 2: 12}, 4)


def test_even_placement_uneven_and_without_rank0():
    p = Placement.even({0: 10}, 3)
    assert sorted(p.layers[0].count((r,)) for r in range(3)) == [3, 3, 4]
    q = Placement.even({0: 12}, 4, rank0_experts=False)
    assert (0,) not in q.layers[0] and set(q.layers[0]) == {(1,), (2,), (3,)}
    q.validate({0: 12}, 4)


@pytest.mark.parametrize(
    "layers,ranks,message",
    [
        ({0: [0, 1, 5, 1]}, 2, "does not exist"),
        ({0: [0, 1, 1]}, 2, "lists 3 experts"),
        ({1: [0, 1, 0, 1]}, 2, "do not match"),
        ({0: [0, 0, 0, 0]}, 2, "own no expert"),
        ({0: [0, 1, 0, 1]}, 3, "placement is for 2 ranks"),
    ],
)
def test_placement_validation_errors(layers, ranks, message):
    p = Placement(2, {l: [(r,) for r in row] for l, row in layers.items()})
    with pytest.raises(PlacementError, match=message):
        p.validate({0: 4}, ranks)


def test_more_ranks_than_experts_is_refused():
    with pytest.raises(PlacementError, match="only 4"):
        resolve_placement(None, {0: 4}, 6)


def test_placement_json_round_trip(tmp_path):
    p = Placement.even({0: 8, 1: 8}, 2)
    path = tmp_path / "p.json"
    p.save(path)
    assert json.loads(path.read_text())["version"] == 1
    assert Placement.load(path) == p


@pytest.mark.parametrize(
    "text,message",
    [("{not json", "not JSON"), ('{"version": 9}', "version"), ('{"version": 1}', "malformed"), ("[1]", "object")],
)
def test_malformed_placement_files(tmp_path, text, message):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(PlacementError, match=message):
        Placement.load(path)


def test_command_round_trip():
    c = GenerateCommand([[1, 2, 3]], GenerationParams(temp=0.5))
    assert commands.decode(commands.encode(c)) == c


@pytest.mark.parametrize(
    "data,message",
    [
        (b"\x80\x04pickle", "not JSON"),
        (b'{"op": "load", "version": 99}', "version 99"),
        (b'{"op": "explode", "version": %d}' % commands.PROTOCOL_VERSION, "unknown command"),
        (b'{"op": "load", "version": %d, "args": [1]}' % commands.PROTOCOL_VERSION, "not a JSON object"),
    ],
)
def test_bad_commands_are_refused(data, message):
    with pytest.raises(ProtocolError, match=message):
        commands.decode(data)


def test_ownership_local_index_is_position_in_owner_stack():
    ownership = LayerOwnership.build(3, [0, 1, 1, 0, 2, 1], rank=1)
    assert ownership.owned_experts.tolist() == [1, 2, 5]
    assert ownership.local_index.tolist() == [0, 0, 1, 1, 0, 2]
    local, owned = ownership.masked_table()  # experts held elsewhere point at local 0, masked off
    assert local.tolist() == [0, 0, 1, 0, 0, 2] and owned.tolist() == [False, True, True, False, False, True]


def test_pack_layout():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    msg = pack(1, 7, mx.float32, np.array([4, 2, 5]), np.array([0, 1, 1]), x, step=5, total_slots=16)
    assert msg[:32].view(np.int32).tolist() == [1, 7, 0, 3, 2, 3, 5, 16]
    assert msg[32:44].view(np.int32).tolist() == [4, 2, 5]
    assert msg[44:56].view(np.int32).tolist() == [0, 1, 1]
    assert np.array_equal(msg[56:].view(np.float32).reshape(2, 3), x)
    back = unpack(msg)
    assert (back.op, back.layer, back.step, back.total_slots, back.local_ids.tolist(), back.slot_rows.tolist()) == (
        1, 7, 5, 16, [4, 2, 5], [0, 1, 1])
    assert np.array_equal(np.array(back.x), x)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_numpy_round_trip_keeps_bits(dtype):
    a = (mx.random.normal((5, 7)) * 3).astype(dtype)
    b = from_numpy(to_numpy(a).copy(), dtype)
    assert b.dtype == dtype
    assert mx.array_equal(a.view(mx.uint16 if dtype != mx.float32 else mx.uint32),
                          b.view(mx.uint16 if dtype != mx.float32 else mx.uint32))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.uint32])
def test_read_rows_matches_slicing(tmp_path, dtype):
    w = (mx.random.normal((6, 4, 8)) * 100).astype(dtype)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"a.weight": w, "b": mx.ones((3,))})
    index = read_safetensors_index(tmp_path)
    rows = read_rows(index["a.weight"], [4, 1, 5])
    assert rows.dtype == dtype
    assert mx.array_equal(rows, w[mx.array([4, 1, 5])])


def test_truncated_safetensors_is_detected(tmp_path):
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"a": mx.ones((64, 64))})
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        read_safetensors_index(tmp_path)


def test_hostile_safetensors_headers_are_refused_in_one_line(tmp_path):
    """A header length past the format's limit is refused before anything
    that long is read; a header that is not a JSON object is refused too."""
    import struct

    file = tmp_path / "model.safetensors"
    for data, says in [(struct.pack("<Q", 1 << 60) + b"{}", "header of 1152921504606846976 bytes"),
                       (struct.pack("<Q", 2) + b"[]", "a JSON list where the header's object should be"),
                       (struct.pack("<Q", 8) + b'{"a": 1}', "not a valid safetensors file"),
                       (struct.pack("<Q", 9) + b'{"a": 1}', "truncated inside its safetensors header")]:
        file.write_bytes(data)
        with pytest.raises(CheckpointError, match=re.escape(says)):
            read_safetensors_index(tmp_path)


def test_finds_real_libmpi():
    lib = find_libmpi()
    assert lib is not None and "libmpi" in lib


def test_fingerprint_mismatch_names_what_differs():
    from mlxdist.commands.executor import describe_mismatch

    ref = {"mlxdist": "1", "options": "a", "placement": "p"}
    assert describe_mismatch([ref, dict(ref)]) is None
    line = describe_mismatch([ref, {**ref, "options": "b"}, dict(ref)])
    assert line == "ranks loaded different things than rank 0: rank 1 (load options)"


def test_load_options_are_checked():
    from mlxdist.config import LoadOptions
    from mlxdist.errors import UserError

    LoadOptions("m", "p2p", "compact").validate()
    with pytest.raises(UserError, match="unknown layout 'dense'"):
        LoadOptions("m", layout="dense").validate()
    with pytest.raises(UserError, match="unknown dispatch mode 'nccl'"):
        LoadOptions("m", mode="nccl").validate()


def test_fault_injection_is_off_unless_it_names_this_rank(monkeypatch):
    from mlxdist.runtime import faults

    monkeypatch.delenv("MLXDIST_FAULT", raising=False)
    assert faults.arm(0) is None and faults.FAULT is None
    monkeypatch.setenv("MLXDIST_FAULT", "kill:rank=1,layer=2,step=3")
    assert faults.arm(0) is None and faults.FAULT is None
    fault = faults.arm(1)
    assert (fault.action, fault.layer, fault.step) == ("kill", 2, 3) and faults.FAULT is fault
    monkeypatch.delenv("MLXDIST_FAULT")
    assert faults.arm(1) is None


def test_expert_load_is_counted_only_when_asked():
    from mlxdist.dispatch import ExchangeStats

    stats = ExchangeStats()
    assert stats.count(0, mx.array([[1, 2]]), 4) is None and stats.expert_load == {}
    stats.collect_expert_load = True
    stats.count(0, mx.array([[1, 2]]), 4)
    stats.count(0, np.array([2, 3]), 4)
    assert np.asarray(stats.expert_load[0]).tolist() == [0, 1, 2, 1]
    stats.reset()
    assert stats.collect_expert_load and stats.expert_load == {}


def test_one_rank_dispatch_is_the_identity():
    from mlxdist.dispatch import DISPATCH_MODES, LayerOwnership, make_dispatcher
    from mlxdist.runtime.world import World

    world = World(0, 1, None)
    x, inds = mx.random.normal((2, 3, 8)), mx.array([[[0, 1]] * 3] * 2)
    for mode in DISPATCH_MODES[1:]:  # "auto" is the engine's choice between two of them
        dispatcher = make_dispatcher(mode, world)
        batch, handle = dispatcher.dispatch(LayerOwnership.build(0, [0, 0], 0), x, inds)
        assert batch.x is x and batch.inds is inds
        y = mx.ones((2, 3, 2, 8))
        assert dispatcher.combine(y, handle) is y


@pytest.mark.parametrize("dtype, weights_dtype, top_k", [
    ("bfloat16", "bfloat16", 8), ("bfloat16", "float32", 8), ("float32", "bfloat16", 3), ("float32", "float32", 4)])
def test_dp_gathers_rows_weights_and_ids_as_sent(dtype, weights_dtype, top_k):
    """dp packs a token's row, router weights and expert ids into one row of
    the activations' dtype: the weights travel in their own dtype (float32
    where they would not fill whole columns), the ids as their own bits."""
    from mlxdist.dispatch import DataParallelDispatcher, LayerOwnership
    from mlxdist.runtime.world import World

    dtype, weights_dtype = getattr(mx, dtype), getattr(mx, weights_dtype)
    world = World(0, 1, mx.distributed.init(strict=False))  # a group of one: the gather returns what it sent
    dispatcher = DataParallelDispatcher(world, "masked", top_k, dtype, weights_dtype)
    experts = 16
    x = mx.random.normal((2, 3, 32)).astype(dtype)
    inds = mx.argpartition(mx.random.normal((2, 3, experts)), kth=-top_k, axis=-1)[..., -top_k:]  # uint32, as blocks route
    weights = mx.random.uniform(shape=(2, 3, top_k)).astype(weights_dtype)
    dispatcher.plan([6])
    dispatcher.begin_forward()
    batch, handle = dispatcher.dispatch(LayerOwnership.build(0, [0] * experts, 0), x, inds, weights)
    assert mx.array_equal(batch.x, x.reshape(6, 32))
    assert batch.inds.tolist() == inds.reshape(6, top_k).tolist()
    fits = weights_dtype == dtype or top_k * weights_dtype.size % dtype.size == 0
    assert handle.weights.dtype == (weights_dtype if fits else mx.float32)
    assert mx.array_equal(handle.weights, weights.reshape(6, top_k).astype(mx.float32))


def test_dp_counts_what_each_collective_hands_over():
    """dp's byte counters are the arrays each collective takes from this rank
    and hands back to it: the gather returns every rank's rows, and MPI's
    all_sum (no reduce-scatter there) the whole sum, not 1/N of it."""
    from mlxdist.dispatch import DataParallelDispatcher, LayerOwnership
    from mlxdist.runtime.world import World

    world = World(0, 1, mx.distributed.init(strict=False), backend="mpi")
    dispatcher = DataParallelDispatcher(world, "masked", 2, mx.float32, mx.float32)
    x, inds = mx.random.normal((6, 8)), mx.array([[0, 1]] * 6)
    dispatcher.plan([6])
    dispatcher.begin_forward()
    batch, handle = dispatcher.dispatch(LayerOwnership.build(0, [0, 0], 0), x, inds, mx.ones((6, 2)))
    packed = 6 * (8 + 2 + 2) * 4  # [T, D + K weights + K ids] float32, gathered from a group of one
    assert (dispatcher.stats.bytes_sent, dispatcher.stats.bytes_received) == (packed, packed)
    dispatcher.combine(mx.ones((6, 2, 8)), handle)
    partial = 6 * 8 * 4  # [N*T, D]: all_sum's input and, whole, its result
    assert (dispatcher.stats.bytes_sent, dispatcher.stats.bytes_received) == (packed + partial, packed + partial)


@pytest.mark.parametrize("batch, ranks, backend, expect", [
    (1, 2, "mpi", "collective"), (2, 2, "mpi", "dp"), (3, 4, "mpi", "collective"), (4, 4, "mpi", "dp"),
    (8, 2, "nccl", "collective"), (15, 2, "nccl", "collective"), (16, 2, "nccl", "dp"), (32, 4, "nccl", "dp"),
    (24, 4, "nccl", "collective")])
def test_auto_runs_dp_once_every_rank_has_enough_rows(batch, ranks, backend, expect):
    from mlxdist.decide.rule import auto_mode

    assert auto_mode(batch, ranks, backend) == expect


@pytest.mark.parametrize("backend, below", [("mpi", "collective-tp"), ("nccl", "collective")])
def test_auto_with_experts_cut_in_width_runs_dp_from_one_row_per_rank(backend, below):
    """Below one row per rank: attention split too on MPI (tensor parallel
    there), not on NCCL, where each collective costs host time per step."""
    from mlxdist.decide.rule import auto_mode

    assert auto_mode(1, 2, backend, "width") == below
    assert auto_mode(2, 2, backend, "width") == "dp"
    assert auto_mode(3, 4, backend, "width") == below
    assert auto_mode(8, 2, backend, "width") == "dp"


def test_wire_traffic_model():
    from mlxdist.bench.links import LINKS, Shape, projected_tps, traffic

    shape = Shape(hidden=2048, top_k=8, layers=48, moe_layers=48, itemsize=2)
    t = {s: traffic(s, 2, 32, shape) for s in ("collective", "dp", "tensor", "replicas")}
    assert t["collective"]["bytes_per_token_layer"] == 8 * 2048 * 2  # all_sum of K slots: K x D x s at N = 2
    assert t["tensor"]["bytes_per_token_layer"] == 2 * 2048 * 2  # two all_sums of D
    assert t["dp"]["bytes_per_token_layer"] == (2048 * 2 + 8 * 6) / 2 + 2048 * 2  # half the rows out, the sum back
    assert t["dp"]["bytes_per_token_layer"] < t["tensor"]["bytes_per_token_layer"]
    assert (t["dp"]["collectives_per_layer"], t["replicas"]["collectives_per_layer"]) == (2, 0)
    width = {s: traffic(s, 2, 32, shape)["bytes_per_token_layer"] for s in ("dp-width", "collective-width")}
    assert width == {"dp-width": 2048 * 2 / 2 + 2048 * 2, "collective-width": 2048 * 2}  # no ids, no weights, no K
    for split_attention in ("collective-tp", "collective-tp-width"):  # the block sums [.., D]: tensor parallelism's
        assert traffic(split_attention, 2, 32, shape) == t["tensor"]
    slow, fast = (projected_tps("dp", 2, 32, shape, 0.05, LINKS[k]) for k in ("10 GbE (TCP)", "Thunderbolt 5 (RDMA)"))
    assert slow < fast < 32 / 0.05


def test_report_counts_width_rows_as_whole_block_exchanges():
    from mlxdist.bench.report import _wire_mode

    row = {"contender": "mlxdist dp", "strategy": "dp", "dispatch": "auto"}
    assert _wire_mode(row) == "dp"
    assert _wire_mode({**row, "expert_split": "width"}) == "dp-width"
    assert _wire_mode({**row, "strategy": "collective", "expert_split": "width"}) == "collective-width"
    assert _wire_mode({**row, "strategy": "collective-tp", "expert_split": "width"}) == "collective-tp-width"
    assert _wire_mode({**row, "expert_split": "width", "link": False}) is None
    assert _wire_mode({"contender": "mlx-lm tensor"}) == "tensor"


def test_nccl_rendezvous_is_per_job():
    """Every rank gets rank 0's choice; two jobs get different free ports."""
    from conftest import ROOT, launch

    jobs = []
    for _ in range(2):
        proc = launch(3, [ROOT / "tests/scripts/rendezvous.py"], module=None, env={"NCCL_PORT": "", "NCCL_HOST_IP": ""})
        assert proc.returncode == 0, proc.stderr[-2000:]
        answers = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
        assert sorted(a["rank"] for a in answers) == [0, 1, 2]
        assert len({(a["host"], a["port"]) for a in answers}) == 1
        jobs.append(answers[0])
    assert all(j["host"] == "127.0.0.1" and 1024 < j["port"] < 65536 for j in jobs)
    assert jobs[0]["port"] != jobs[1]["port"]


@pytest.mark.parametrize("slots,total,expect", [(3, 5, 3), (3, 8, 8), (7, 63, 8), (9, 63, 9), (3, 64, 64), (70, 200, 70), (0, 0, 0)])
def test_padded_slots_keep_the_kernel_class_of_the_whole_layer(slots, total, expect):
    assert padded_slots(slots, total) == expect


def test_padded_expert_call_returns_the_same_rows():
    from mlx_lm.models.switch_layers import SwitchGLU

    mx.random.seed(3)
    experts = SwitchGLU(16, 32, 4)
    mx.eval(experts.parameters())
    x = mx.random.normal((3, 16))
    inds = mx.array([[2], [0], [3]])
    plain = experts(x, inds)
    padded = run_experts(experts, ExpertBatch(x, inds, total_slots=100), pad=True)  # computes 64 rows, keeps 3
    assert padded.shape == plain.shape == (3, 1, 16)
    assert mx.allclose(padded, plain, atol=1e-6).item()
    assert run_experts(experts, ExpertBatch(x, inds, total_slots=100), pad=False).shape == (3, 1, 16)



@pytest.mark.parametrize("kind", ["glu", "glu-4bit", "mlp-bias"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_experts_cut_in_width_sum_to_the_whole(kind, ranks):
    """Each rank's width cut of an expert module computes its part of every
    slot; the parts over the ranks add up to the whole module's output (a
    bias on the way back counted once)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    from mlxdist.model.checkpoint import SwitchSite, split_experts_by_width

    D, H, E = 64, 256, 6

    def make():
        mx.random.seed(3)
        m = SwitchMLP(D, H, E, bias=True) if kind == "mlp-bias" else SwitchGLU(D, H, E)
        if kind == "glu-4bit":
            nn.quantize(m, group_size=32, bits=4)
        mx.eval(m.parameters())
        return m

    whole = make()
    x = mx.random.normal((5, D))
    inds = mx.array([[e % E, (e + 2) % E] for e in range(5)], dtype=mx.uint32)
    expected = whole(x, inds)
    parts = []
    for rank in range(ranks):
        module = make()
        split_experts_by_width(SwitchSite(0, "m", None, "m", module), rank, ranks)
        assert all(v.shape[0] == E for _, v in tree_flatten(module.parameters()))
        parts.append(module(x, inds))
    assert mx.allclose(sum(parts), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bits", [None, 4])
def test_shared_experts_cut_in_width_sum_to_the_whole(bits):
    """A block's shared expert (an MLP beside the switch) is cut like the
    experts: the ranks' whole-block outputs add up to the whole block's; the
    router and the switch are left to their own cuts."""
    import mlx.nn as nn
    from mlx_lm.models.deepseek_v3 import DeepseekV3MLP
    from mlx_lm.models.switch_layers import SwitchGLU

    from mlxdist.model.checkpoint import SwitchSite, split_shared_by_width

    D, H = 64, 128

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(D, 4, bias=False)
            self.switch_mlp = SwitchGLU(D, H, 4)
            self.shared_experts = DeepseekV3MLP(None, hidden_size=D, intermediate_size=H)

        def __call__(self, x):
            return self.gate(x).sum(-1, keepdims=True) + self.shared_experts(x)

    def make():
        mx.random.seed(5)
        b = Block()
        if bits:
            nn.quantize(b, group_size=32, bits=bits)
        mx.eval(b.parameters())
        return b

    x = mx.random.normal((3, D))
    whole = make()
    expected = whole.shared_experts(x)
    parts = []
    for rank in range(2):
        block = make()
        site = SwitchSite(0, "layers.0.mlp.switch_mlp", block, "switch_mlp", block.switch_mlp)
        assert split_shared_by_width(site, rank, 2) == ["shared_experts"]
        assert block.gate.weight.shape == whole.gate.weight.shape
        assert block.switch_mlp.down_proj.weight.shape == whole.switch_mlp.down_proj.weight.shape
        parts.append(block.shared_experts(x))
    assert mx.allclose(parts[0] + parts[1], expected, atol=1e-4, rtol=1e-4)


def test_a_shared_mlp_of_unknown_projections_is_refused():
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    from mlxdist.errors import UserError
    from mlxdist.model.checkpoint import SwitchSite, split_shared_by_width

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj = nn.Linear(8, 16)
            self.down_proj = nn.Linear(16, 8)
            self.w3 = nn.Linear(8, 16)

    block = nn.Module()
    block.switch_mlp = SwitchGLU(8, 16, 2)
    block.shared = Odd()
    with pytest.raises(UserError, match=r"cannot cut layers.0.mlp.shared in width: projections \['down_proj', 'up_proj', 'w3'\]"):
        split_shared_by_width(SwitchSite(0, "layers.0.mlp.switch_mlp", block, "switch_mlp", block.switch_mlp), 0, 2)


@pytest.mark.parametrize("kind", ["glu", "glu-4bit", "mlp-bias"])
def test_experts_called_unsorted_match_mlx_lm(kind):
    """From 64 slots mlx-lm sorts the slots by expert before its gather
    matmuls; called without the sort the experts give the same outputs."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    from mlxdist.model.experts import call_unsorted

    mx.random.seed(4)
    m = SwitchMLP(32, 64, 8, bias=True) if kind == "mlp-bias" else SwitchGLU(32, 64, 8)
    if kind == "glu-4bit":
        nn.quantize(m, group_size=32, bits=4)
    x = mx.random.normal((20, 1, 32))
    inds = mx.random.randint(0, 8, (20, 1, 4)).astype(mx.uint32)  # 80 slots: mlx-lm sorts
    assert mx.allclose(call_unsorted(m, x, inds), m(x, inds), atol=1e-5, rtol=1e-5)

    class Own(SwitchGLU):  # a subclass may call its parts otherwise: called as it is
        def __call__(self, x, indices):
            return mx.zeros(indices.shape + x.shape[-1:])

    own = Own(32, 64, 8)
    assert not call_unsorted(own, x, inds).any().item()
    big = mx.random.randint(0, 8, (20, 1, 16)).astype(mx.uint32)  # 320 slots: mlx-lm's own call, sorted
    assert mx.allclose(call_unsorted(m, x, big), m(x, big), atol=1e-5, rtol=1e-5)


def test_expert_split_options_refused_with_one_line():
    from mlxdist.config import LoadOptions
    from mlxdist.errors import UserError

    for kwargs, words in [(dict(mode="p2p"), "runs with --mode auto, dp, collective or collective-tp, not p2p"),
                          (dict(expert_capacity=2, layout="compact"), "takes no placement"),
                          (dict(rank0_experts=False), "--no-rank0-experts"),
                          (dict(expert_split="diagonal"), "unknown expert split")]:
        options = LoadOptions("m", **{"expert_split": "width", **kwargs})
        with pytest.raises(UserError, match=words):
            options.validate()


def test_experts_that_do_not_cut_evenly_are_refused_by_name():
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    from mlxdist.errors import UserError
    from mlxdist.model.checkpoint import SwitchSite, split_experts_by_width

    module = SwitchGLU(64, 64, 4)
    nn.quantize(module, group_size=64, bits=4)  # one group of hidden units per row of down_proj
    with pytest.raises(UserError, match="m.down_proj in width over 2 ranks: its 1 quantization groups"):
        split_experts_by_width(SwitchSite(0, "m", None, "m", module), 0, 2)


def test_projection_reads_what_a_roofline_reading_of_deepseek_v3_reads():
    """bench project: DeepSeek-V3 at 4 bits reads ~20.7 GB a token on one
    machine, ~9.3 GB of it the dense part (DESIGN.md's reading); the busiest
    of N ranks holds E[max] of a token's experts, exact for small cases."""
    from mlxdist.bench.projection import MODELS, expected_busiest, project

    ds = MODELS["DeepSeek-V3"]
    assert abs(ds.gb(ds.dense_params) - 9.3) < 0.5
    one = project(ds, 2, 819.0, 150.0)["one machine"]
    assert abs(one["gb_per_token"] - 20.7) < 0.5 and one["collectives"] == 0
    assert expected_busiest(8, 1, 3) == 3.0  # one rank holds them all
    assert abs(expected_busiest(4, 2, 2) - (2 * 2 + 1 * 4) / 6) < 1e-12  # both on one rank in 2 of the 6 pairs
    rows = project(ds, 4, 819.0, 150.0)
    assert rows["tensor parallel"]["collectives"] == 2 * 61 and rows["mlxdist collective"]["collectives"] == 58
    assert rows["tensor parallel"]["gb_per_token"] < rows["mlxdist collective"]["gb_per_token"]
    # cut in width, collective-tp reads and runs what tensor parallelism does; gpt-oss-120b's 90
    # quantization groups across an expert's hidden units do not divide by 4: no such row there
    assert rows["mlxdist collective-tp, width"] == rows["tensor parallel"]
    assert "mlxdist collective-tp, width" in project(MODELS["gpt-oss-120b"], 2, 819.0, 150.0)
    assert "mlxdist collective-tp, width" not in project(MODELS["gpt-oss-120b"], 4, 819.0, 150.0)
