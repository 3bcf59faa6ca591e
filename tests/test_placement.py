"""Placements with replicas (format v2, hostile files), placement from
routing statistics (python -m mlxdist.place), and per-rank memory budgets.
Unit tests first (fast); then real mpirun at np = 2: routing recorded by the
command line, the API under dp and the server, reloaded and turned into a
placement; budgets giving 2:1 experts with tokens equal to mlx-lm's, and a
budget too small refused naming the rank."""

import functools
import json
import time

import pytest

from conftest import error_lines, last_json, launch, mlx_lm_loaded
from mlxdist.errors import PlacementError, UserError
from mlxdist.model.balance import balanced, imbalance
from mlxdist.model.fit import check_rank_memory
from mlxdist.model.budgets import budgets_for_ranks, parse_rank_memory
from mlxdist.values.placement import Placement
from mlxdist.model.routing_file import RoutingStats

NP = 2
PROMPT = "The quick brown fox jumps over the lazy dog because"


def zipf(num_experts=16, layers=3, scale=1000):
    return {l: [int(scale / (1 + ((e * 7 + l) % num_experts))) for e in range(num_experts)] for l in range(layers)}


# -- the placement value and its file ------------------------------------------

def test_v1_is_written_without_replicas_and_v2_with_them(tmp_path):
    even = Placement.even({0: 4, 1: 4}, 2)
    assert even.to_json()["version"] == 1 and even.to_json()["layers"]["0"] == [0, 0, 1, 1]
    rep = Placement(2, {0: [(0,), (0, 1), (1,), (1,)], 1: [(0,), (0,), (1,), (1,)]})
    assert rep.to_json() == {"version": 2, "num_ranks": 2, "layers": {"0": [0, [0, 1], 1, 1], "1": [0, 0, 1, 1]}}
    assert rep.experts_of(0, 0) == [0, 1] and rep.experts_of(0, 1) == [1, 2, 3]
    rep.validate({0: 4, 1: 4}, 2)
    for p in (even, rep):
        path = tmp_path / "p.json"
        p.save(path)
        assert Placement.load(path) == p
    v1 = Placement.from_json({"version": 1, "num_ranks": 2, "layers": {"0": [0, 1, 1, 0]}})
    assert v1.layers[0] == [(0,), (1,), (1,), (0,)]


@pytest.mark.parametrize("obj,message", [
    ({"version": True, "num_ranks": 2, "layers": {}}, "version"),
    ({"version": 2, "num_ranks": True, "layers": {"0": [0, 1]}}, "num_ranks"),
    ({"version": 2, "num_ranks": 10 ** 30, "layers": {"0": [0, 1]}}, "num_ranks"),
    ({"version": 2, "num_ranks": 2, "layers": {"0": [0, [1, 1]]}}, "twice"),
    ({"version": 2, "num_ranks": 2, "layers": {"0": [0, []]}}, "no owner"),
    ({"version": 2, "num_ranks": 2, "layers": {"0": [0, [1, 2]]}}, "rank 2 does not exist"),
    ({"version": 2, "num_ranks": 2, "layers": {"0": [0, -1]}}, "does not exist"),
    ({"version": 2, "num_ranks": 2, "layers": {"0": [0, True]}}, "neither a rank"),
    ({"version": 2, "num_ranks": 2, "layers": {"0": [0, [True]]}}, "not a rank number"),
    ({"version": 2, "num_ranks": 2, "layers": {"0": [0, 1.0]}}, "neither a rank"),
    ({"version": 2, "num_ranks": 2, "layers": {"0": [0, [[1]]]}}, "not a rank number"),
    ({"version": 1, "num_ranks": 2, "layers": {"0": [0, [0, 1]]}}, "not a rank number"),
    ({"version": 2, "num_ranks": 2, "layers": {"x": [0, 1]}}, "layer key"),
    ({"version": 2, "num_ranks": 2, "layers": {"0": {}}}, "must list"),
    ({"version": 2, "num_ranks": 2, "layers": [0, 1]}, "layers must be an object"),
    ({"version": 2, "num_ranks": 2, "layers": {"0": [0, 10 ** 40]}}, "does not exist"),
])
def test_hostile_placements_are_one_line_errors(obj, message):
    with pytest.raises(PlacementError, match=message) as e:
        Placement.from_json(obj)
    assert "\n" not in str(e.value) and len(str(e.value)) < 200


@pytest.mark.parametrize("text,message", [
    ('{"version": 2, "num_ranks": 2, "layers": {"0": [0, ' + "9" * 5000 + "]}}", "not JSON mlxdist reads"),
    ("[" * 100_000 + "]" * 100_000, "nests deeper than 64 levels"),
])
def test_hostile_placement_files(tmp_path, text, message):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(PlacementError, match=message):
        Placement.load(path)


def test_huge_placement_file_is_refused_unread(tmp_path):
    path = tmp_path / "p.json"
    with open(path, "wb") as f:
        f.truncate((64 << 20) + 10)
    with pytest.raises(PlacementError, match="larger than 64 MiB"):
        Placement.load(path)


def test_replica_validation_against_the_world():
    p = Placement(3, {0: [(0,), (0, 1), (0,), (0,)]})
    with pytest.raises(PlacementError, match=r"rank\(s\) \[2\] own no expert"):
        p.validate({0: 4}, 3)


# -- budgets ---------------------------------------------------------------------

def test_even_with_budgets_gives_experts_in_proportion():
    assert Placement.even({0: 12}, 2, budgets=[1, 1]) == Placement.even({0: 12}, 2)
    held = Placement.even({0: 12, 1: 12}, 2, budgets=[2, 1]).held_counts()
    assert held == {0: [8, 4], 1: [8, 4]}
    assert Placement.even({0: 8}, 3, budgets=[100, 1, 1]).held_counts()[0] == [6, 1, 1]  # each at least one
    assert parse_rank_memory("64,32.5") == [64.0, 32.5]
    assert parse_rank_memory("mac1.local=64,Mac2=32") == {"mac1.local": 64.0, "Mac2": 32.0}
    for bad in ("64,x", "64,0", "64,-1", "inf,1", "a=1,b=0", "=3", "a=1,A.local=2"):
        with pytest.raises(UserError):
            parse_rank_memory(bad)


def test_budgets_for_ranks_by_host_name_never_by_position():
    """One matcher for every form: names without case or domain (an IP address whole), a host's GB split
    evenly over its ranks, a rank on a host not named refused naming it; a list is per rank, as given."""
    named = {"mac1.local": 64.0, "Mac2": 32.0}
    assert budgets_for_ranks(named, ["mac2.local", "MAC1"]) == [32.0, 64.0]
    assert budgets_for_ranks(named, ["mac1", "Mac1.lan", "mac2"]) == [32.0, 32.0, 32.0]
    assert budgets_for_ranks({"10.0.0.1": 8.0}, ["10.0.0.1", "10.0.0.1"]) == [4.0, 4.0]
    with pytest.raises(UserError, match="rank 1 runs on host a, which --rank-memory does not name"):
        budgets_for_ranks(named, ["mac1", "a"])
    with pytest.raises(UserError, match="rank 0 runs on host 10.0.0.2"):
        budgets_for_ranks({"10.0.0.1": 8.0}, ["10.0.0.2"])
    with pytest.raises(UserError, match="gives host MAC1 two budgets"):
        budgets_for_ranks({"mac1": 1.0, "MAC1": 2.0}, ["mac1"])
    assert budgets_for_ranks([1.0, 2.0], ["mac2", "mac1"]) == [1.0, 2.0]
    with pytest.raises(UserError, match="2 budgets for 3 ranks"):
        budgets_for_ranks([1.0, 2.0], ["a", "b", "c"])


def test_rank_memory_check_names_the_rank_and_the_excess():
    plan = Placement.even({0: 4, 1: 4}, 2)
    per_expert = {0: 0.5e9, 1: 0.5e9}  # 2 experts x 2 layers x 0.5 GB = 2 GB per rank
    assert check_rank_memory(plan, 1, 2.0, per_expert) == pytest.approx(2.0)
    with pytest.raises(UserError, match=r"rank 1 holds 4 experts: 2 GB .* over its --rank-memory 1.5 GB by 0.5 GB"):
        check_rank_memory(plan, 1, 1.5, per_expert)
    assert check_rank_memory(plan, 1, 1.5, per_expert, capacity=1) == pytest.approx(1.0)  # paged: 1 resident


# -- the balancing policy --------------------------------------------------------

def test_balanced_beats_even_on_skewed_routing():
    counts = zipf()
    even = Placement.even({l: 16 for l in counts}, 2)
    plan = balanced(counts, 2)
    plan.validate({l: 16 for l in counts}, 2)
    assert imbalance(even, counts) > 0.2
    assert imbalance(plan, counts) < 0.02 < imbalance(even, counts) / 10
    assert plan.held_counts() == even.held_counts()  # the same memory as even placement


def test_replicas_lower_it_further():
    counts = {0: [5000] + [100] * 15, 1: [100] * 15 + [4000]}  # one expert carries most of each layer
    plain, replicated = balanced(counts, 4), balanced(counts, 4, duplicates=1)
    assert imbalance(replicated, counts) < imbalance(plain, counts) / 2
    assert replicated.duplicated and not plain.duplicated
    hot = replicated.layers[0][0]
    assert len(hot) >= 2 and len(set(hot)) == len(hot)
    assert all(c == 16 // 4 + 1 for c in replicated.held_counts()[0])  # E/N + R slots each
    Placement.from_json(replicated.to_json()).validate({0: 16, 1: 16}, 4)


def test_budgets_two_to_one_give_two_to_one_experts():
    counts = zipf(num_experts=12)
    held = balanced(counts, 2, budgets=[2.0, 1.0]).held_counts()
    assert all(c == [8, 4] for c in held.values())


def test_the_policy_is_deterministic():
    counts = zipf(num_experts=32, layers=4)
    a, b = balanced(counts, 4, duplicates=2), balanced({l: list(c) for l, c in reversed(counts.items())}, 4, duplicates=2)
    assert json.dumps(a.to_json()) == json.dumps(b.to_json())


def test_place_command(tmp_path, capfd):
    from mlxdist.cli.place import main

    routing = tmp_path / "routing.json"
    RoutingStats(zipf(), top_k=2, model_type="x").save(routing)
    out = tmp_path / "placement.json"
    assert main([str(routing), "--ranks", "2", "--duplicates", "1", "-o", str(out)]) == 0
    text = capfd.readouterr().out
    ratios = [float(x) for x in text.split("even ")[1].replace(",", "").split()[:1]]
    assert "predicted imbalance ratio" in text and ratios[0] > 0.2
    assert Placement.load(out).num_ranks == 2
    assert Placement.load(out).duplicated
    capfd.readouterr()
    assert main([str(routing), "--ranks", "2", "--replicas", "1", "-o", str(out)]) == 0  # the old spelling, one release
    assert Placement.load(out).duplicated
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "mlxdist-routing", "version": 1, "model": {}, "layers": {"0": [1, -2]}}))
    assert main([str(bad), "--ranks", "2", "-o", str(out)]) == 1
    assert "count >= 0" in capfd.readouterr().err
    assert main([str(routing), "--ranks", "2", "--rank-memory", "mac1=2,mac2=1", "-o", str(out)]) == 1
    assert "plans for ranks, not hosts" in capfd.readouterr().err


# -- under mpirun ----------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def reference_tokens(path, max_tokens):
    """(prompt tokens, mlx-lm's greedy tokens) in this process, once per session."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    model, tokenizer = mlx_lm_loaded(str(path))
    prompt = tokenizer.encode(PROMPT)
    return len(prompt), [r.token for r in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens)]


def run_json(args, nranks=NP):
    proc = launch(nranks, ["--prompt", PROMPT, "--ignore-chat-template", "--json", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return last_json(proc.stdout)


@pytest.mark.parametrize("dispatch", ["collective", "p2p"])
def test_recorded_routing_counts_every_slot_and_places(checkpoint, tmp_path, dispatch):
    """tokens x top_k slots per layer, reloaded; the placement made from it runs bit-exact."""
    path = checkpoint("qwen3_moe")
    top_k = json.loads((path / "config.json").read_text())["num_experts_per_tok"]
    prompt_len, expected = reference_tokens(path, 6)
    routing = tmp_path / "routing.json"
    out = run_json(["--model", path, "-m", 6, "--mode", dispatch, "--record-routing", routing])
    assert out["tokens"] == expected
    stats = RoutingStats.load(routing)
    assert stats.top_k == top_k and stats.tokens == prompt_len + 6  # mlx-lm computes one step ahead
    assert all(sum(c) == (prompt_len + 6) * top_k and len(c) == 12 for c in stats.layers.values())
    placed = tmp_path / "placement.json"
    from mlxdist.cli.place import main

    assert main([str(routing), "--ranks", str(NP), "-o", str(placed)]) == 0
    again = run_json(["--model", path, "-m", 6, "--mode", dispatch, "--placement", placed,
                      "--record-routing", routing])
    assert again["tokens"] == expected
    assert RoutingStats.load(routing).layers == stats.layers  # the same routing, whoever computes it


def test_dp_routing_is_summed_over_the_ranks(checkpoint, tmp_path):
    """Under dp each rank routes its own sequences: the file has both ranks' slots."""
    script = tmp_path / "batch.py"
    script.write_text(
        "import json, sys\nimport mlxdist\n"
        "with mlxdist.init() as c:\n"
        "    for mode in ('collective', 'dp'):\n"
        "        c.load(sys.argv[1], mode=mode, record_routing=sys.argv[2] + mode)\n"
        "        ids = [c.encode('hello world'), c.encode('a b c d e f g h i')]\n"
        "        r = c.run_batch(c.request(ids, max_tokens=[4, 6]))\n"
        "        print(json.dumps({'mode': mode, 'strategy': r[0].stats['strategy'], 'lens': [len(i) for i in ids],"
        " 'layers': c.routing().to_json()['layers']}))\n")
    proc = launch(NP, [script, checkpoint("qwen3_moe"), tmp_path / "r-"], module=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r["mode"]: r for r in map(json.loads, [l for l in proc.stdout.splitlines() if l.startswith("{")])}
    assert runs["dp"]["strategy"] == "dp"
    first = lambda r: sum(r["layers"][min(r["layers"], key=int)])  # noqa: E731
    prompts = sum(runs["dp"]["lens"])
    # dp: no padding, both ranks' prompts and decode steps; collective: left-padded rows as well
    assert 4 * (prompts + 4 + 6 - 2) <= first(runs["dp"]) <= first(runs["collective"])
    assert RoutingStats.load(tmp_path / "r-dp").layers == {int(k): v for k, v in runs["dp"]["layers"].items()}


def test_the_server_records_routing(checkpoint, tmp_path):
    from test_serve import Server, completion

    routing = tmp_path / "routing.json"
    server = Server(checkpoint("qwen3_moe"), extra=["--record-routing", routing, "--record-routing-every", 0.2])
    try:
        for i in range(3):
            completion(server, f"Request {i}: tokens", max_tokens=4)
            time.sleep(0.3)
        assert routing.exists()  # written while serving
        during = RoutingStats.load(routing)
        assert during.tokens > 0
    finally:
        code = server.stop()
    assert code == 0, server.proc.stderr.read()[-3000:]
    final = RoutingStats.load(routing)
    assert final.tokens >= during.tokens and final.top_k == 4
    assert all(sum(c) == final.tokens * 4 for c in final.layers.values())


def test_rank_memory_two_to_one_is_exact(checkpoint, tmp_path):
    path = checkpoint("qwen3_moe")
    _, expected = reference_tokens(path, 6)
    saved = tmp_path / "p.json"
    out = run_json(["--model", path, "-m", 6, "--mode", "collective", "--rank-memory", "2,1",
                    "--save-placement", saved])
    assert out["tokens"] == expected
    held = Placement.load(saved).held_counts()
    assert all(c == [8, 4] for c in held.values())
    assert out["weights_gb"][0]["expert"] == pytest.approx(2 * out["weights_gb"][1]["expert"])


def test_too_small_a_budget_is_refused_naming_the_rank(checkpoint, tmp_path):
    path = checkpoint("qwen3_moe")  # 3 MoE layers of 12 experts, 49152 bytes each
    (line,) = refused(["--model", path, "--prompt", "hi", "--rank-memory", "1,0.0001", "--mode", "p2p"])
    assert "rank 1 holds 3 experts: 0.000147 GB of expert weights, over its --rank-memory 0.0001 GB by" in line
    even = tmp_path / "even.json"
    Placement.even({0: 12, 1: 12, 2: 12}, NP).save(even)  # 18 experts a rank: 0.000885 GB
    (line,) = refused(["--model", path, "--prompt", "hi", "--rank-memory", "1,0.0003", "--placement", even,
                       "--mode", "p2p"])
    assert "rank 1 holds 18 experts" in line and "by 0.000585 GB" in line
    # paging composes: rank 1 owns 18 experts and keeps one per layer resident
    proc = launch(NP, ["--model", path, "--prompt", "hi", "-m", 2, "--rank-memory", "1,0.0003", "--placement", even,
                       "--mode", "p2p", "--expert-capacity", 1])
    assert proc.returncode == 0, proc.stderr[-3000:]


def refused(args):
    proc = launch(NP, args)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return error_lines(proc.stderr, "mlxdist: error:")


def test_rank_memory_from_a_json_hostfile(tmp_path):
    import json

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "a", "ips": ["10.0.0.1"], "memory_gb": 64}, {"ssh": "b", "memory_gb": 32}]))
    assert parse_rank_memory(str(hosts), 2) == {"a": 64.0, "b": 32.0}
    with pytest.raises(PlacementError, match="rank 2 runs on host c, which --rank-memory does not name"):
        budgets_for_ranks(parse_rank_memory(str(hosts)), ["b", "a", "c"])
    for bad, message in [('[{"ssh": "a"}]', 'host 0 has no number "memory_gb"'),
                         ('[{"ssh": "a", "memory_gb": true}]', 'host 0 has no number "memory_gb"'),
                         ('{"ssh": "a"}', "must be a JSON list of hosts"), ("[", "is not JSON"),
                         ('[{"ssh": "a", "memory_gb": -1}]', "must be positive"),
                         ('[{"memory_gb": 1}]', 'host 0 has no "ssh" name'),
                         ('[{"ssh": "a", "memory_gb": 1}, {"ssh": "A.local", "memory_gb": 2}]', "two budgets")]:
        hosts.write_text(bad)
        with pytest.raises(PlacementError, match=message):
            parse_rank_memory(str(hosts))
    with pytest.raises(PlacementError, match="cannot read"):
        parse_rank_memory(str(tmp_path / "missing.json"))
