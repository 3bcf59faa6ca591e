"""The benchmark harness at tiny sizes: it runs, its JSON has the fields, and
the comparison's ratios come from the numbers of the same run."""

import json
import math
import statistics

import pytest

from conftest import ROOT, last_json, launch

SMALL = ["-p", "16", "-g", "4", "-b", "1,2", "-n", "1", "--warmup-tokens", "2"]
ROW_FIELDS = [
    "prompt_tps", "generation_tps", "peak_memory_gb", "layer_ms", "profiled_layer_ms", "expert_ms",
    "exchange_ms", "rest_ms", "floor_us", "exchange_over_floor", "imbalance",
]


@pytest.fixture(scope="module")
def model(checkpoint):
    return checkpoint("qwen3_moe")  # float32: mlx-lm can shard it for tensor parallelism


def test_bench_json_two_ranks(model):
    r = launch(2, ["--model", model, *SMALL, "--json"], module="mlxdist.bench")
    assert r.returncode == 0, r.stderr
    report = last_json(r.stdout)
    assert report["ranks"] == 2 and report["versions"]["mlx"]
    rows = report["results"]
    assert [(x["dispatch"], x["batch"]) for x in rows] == [
        ("auto", 1), ("auto", 2), ("collective", 1), ("collective", 2), ("p2p", 1), ("p2p", 2)
    ]
    # the model on every rank: auto splits the dense part for one sequence (collective-tp) and runs replicas
    # for one per rank
    assert [x["strategy"] for x in rows[:2]] == ["collective-tp", "replicas"]
    assert rows[1]["vs_exact"]["reference"] == "collective" and rows[1]["vs_exact"]["equal_sequences"] == 1.0
    for row in rows:
        replicas = row["strategy"] == "replicas"  # no exchange: no floor to compare it with
        for key in ROW_FIELDS:
            assert (row[key] is None) == (replicas and key in ("floor_us", "exchange_over_floor")), key
        assert row["generation_tps"] > 0 and row["prompt_tps"] > 0
        assert len(row["peak_memory_gb"]) == 2 and min(row["peak_memory_gb"]) > 0
        if replicas:
            continue
        assert row["floor_us"] > 0 and row["exchange_ms"] > 0
        assert math.isclose(row["exchange_over_floor"], row["exchange_ms"] * 1e3 / row["floor_us"])
        assert math.isclose(row["rest_ms"], row["profiled_layer_ms"] - row["expert_ms"] - row["exchange_ms"])
        # layer ms is the timed trials' (the profiled pass, with its syncs, is slower)
        assert math.isclose(row["layer_ms"], 1e3 * row["batch"] / row["generation_tps"] / row["moe_layers"])
        assert 0.0 <= row["imbalance"] <= 1.0  # (max - mean) / mean over two ranks


def test_bench_json_experts_cut_in_width(model):
    """Whole blocks exchanged: every row field is there (the profile splits
    the block's time too) and the floor is of rows, not slots."""
    r = launch(2, ["--model", model, *SMALL, "--mode", "auto", "--expert-split", "width", "--json"],
               module="mlxdist.bench")
    assert r.returncode == 0, r.stderr
    rows = last_json(r.stdout)["results"]
    assert [x["strategy"] for x in rows] == ["collective-tp", "dp"]  # b = 1: attention split too (MPI)
    assert rows[1]["vs_exact"]["reference"] == "collective-tp"  # dp's closeness, against what auto loaded beside it
    for row in rows:
        for key in ROW_FIELDS:
            assert row[key] is not None, key
        assert row["exchange_ms"] > 0 and row["expert_ms"] > 0 and row["expert_split"] == "width"
        assert math.isclose(row["rest_ms"], row["profiled_layer_ms"] - row["expert_ms"] - row["exchange_ms"])
        width = json.loads((model / "config.json").read_text())["hidden_size"]
        assert row["floor_bytes"]["mode"] == f"{row['strategy']}-width"
        assert row["floor_bytes"]["shape"] == [row["batch"] // (2 if row["strategy"] == "dp" else 1), 1, width]


def test_bench_floor_of_collective_tp_is_the_blocks_sum(model):
    """Whole experts with attention split: each MoE block all_sums its
    weighted [.., D] output (mlx-lm's shard()), so the floor times that, not
    the [.., K, D] slots."""
    r = launch(2, ["--model", model, *SMALL, "--mode", "collective-tp", "--json"], module="mlxdist.bench")
    assert r.returncode == 0, r.stderr
    width = json.loads((model / "config.json").read_text())["hidden_size"]
    for row in last_json(r.stdout)["results"]:
        assert row["floor_bytes"]["shape"] == [row["batch"], 1, width]


def test_bench_table_one_process(model):
    r = launch(0, ["--model", model, *SMALL, "--mode", "collective"], module="mlxdist.bench")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].startswith("dispatch") and "gen t/s" in lines[1]
    assert [l.split()[:2] for l in lines[2:4]] == [["collective", "1"], ["collective", "2"]]


def test_bench_rejects_unknown_dispatch(model):
    r = launch(0, ["--model", model, "--mode", "nccl"], module="mlxdist.bench")
    assert r.returncode != 0 and "unknown dispatch mode" in r.stderr


def test_no_link_runs_each_rank_alone(model):
    """--no-link: the same generations with MLX's collectives replaced by local
    stand-ins; the rows say so and carry no floor or closeness."""
    r = launch(2, ["--model", model, *SMALL, "--mode", "dp,collective", "--no-link", "--json"],
               module="mlxdist.bench")
    assert r.returncode == 0, r.stderr
    report = last_json(r.stdout)
    assert report["link"] is False
    rows = report["results"]
    assert [(x["dispatch"], x["batch"]) for x in rows] == [("dp", 1), ("dp", 2), ("collective", 1), ("collective", 2)]
    for row in rows:
        assert row["link"] is False and row["floor_us"] is None and "vs_exact" not in row
        assert row["generation_tps"] > 0
    refused = launch(0, ["--model", model, "--mode", "p2p", "--no-link"], module="mlxdist.bench")
    assert refused.returncode != 0 and "p2p exchanges through mpi4py" in refused.stderr


def test_no_link_stand_ins_keep_the_shapes():
    import mlx.core as mx

    from mlxdist.bench.probes import no_link

    class Group:  # only the size is read
        def size(self):
            return 3

    real = mx.distributed.all_gather
    no_link(None, {"on": True})
    try:
        x = mx.arange(8, dtype=mx.float32).reshape(2, 4)
        assert mx.distributed.all_gather(x, group=Group()).shape == (6, 4)
        assert mx.distributed.all_sum(x, group=Group()).tolist() == x.tolist()
        assert mx.distributed.sum_scatter(mx.concatenate([x] * 3), group=Group()).tolist() == x.tolist()
    finally:
        no_link(None, {"on": False})
    assert mx.distributed.all_gather is real


def test_compare_ratios_from_same_run(model, tmp_path):
    args = ["--model", model, *SMALL, "--ranks", "2", "--mode", "collective", "--out", tmp_path]
    r = launch(0, args, module="mlxdist.bench.compare", timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((tmp_path / "results.json").read_text())
    assert not result["errors"] and not result["unsupported"]
    rows = {(x["contender"], x["ranks"], x["batch"]): x for x in result["results"]}
    assert set(rows) == {
        (c, n, b) for c, n in [("mlx-lm single", 1), ("mlxdist collective", 2), ("mlx-lm tensor", 2),
                               ("mlx-lm pipeline", 2)] for b in (1, 2)
    } | {("mlx-lm instances", 2, 2)}  # instances: b/N sequences each, so only b = 2
    replicas = rows[("mlx-lm instances", 2, 2)]
    assert len(replicas["instances_generation_tps"]) == 2
    # one job's rate: every process's tokens over the slowest one's time, per trial (they start together)
    trials = replicas["instances_trials"]
    jobs = [sum(t["trials_generation_tokens"][i] for t in trials)
            / max(t["trials_generation_tokens"][i] / t["trials_generation_tps"][i] for t in trials)
            for i in range(len(trials[0]["trials_generation_tps"]))]
    assert math.isclose(replicas["generation_tps"], statistics.median(jobs))
    assert replicas["generation_tps"] <= sum(replicas["instances_generation_tps"]) * (1 + 1e-9)
    assert math.isclose(rows[("mlxdist collective", 2, 2)]["vs_instances"],
                        rows[("mlxdist collective", 2, 2)]["generation_tps"] / replicas["generation_tps"])
    for (contender, n, b), row in rows.items():
        single = rows[("mlx-lm single", 1, b)]["generation_tps"]
        assert math.isclose(row["vs_single"], row["generation_tps"] / single)
        if n == 2:
            assert math.isclose(row["vs_tensor"], row["generation_tps"] / rows[("mlx-lm tensor", 2, b)]["generation_tps"])
            assert math.isclose(row["vs_pipeline"], row["generation_tps"] / rows[("mlx-lm pipeline", 2, b)]["generation_tps"])
    table = (tmp_path / "results.md").read_text()
    assert "| 2 | mlxdist collective | 1 |" in table and "exchange ≤ 1.5× floor" in table
    assert "| 2 | mlxdist collective (collective) | 2 |" in table  # wire traffic and link projections
    assert "| 4 | 2 |" in table and "Thunderbolt 5" in table
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "generation_tps.png").stat().st_size > 0


def test_bench_commands_and_one_rank(model):
    """``python -m mlxdist.bench COMMAND``: an unknown command is one line; one-rank
    prints mlxdist and mlx-lm side by side, in one process, with the median
    of their per-round ratios."""
    bad = launch(0, ["nope"], module="mlxdist.bench")
    assert bad.returncode != 0 and "unknown command 'nope'" in bad.stderr and bad.stderr.count("\n") == 1
    r = launch(0, ["one-rank", model, "-b", "1,2", "-p", "8", "-g", "4", "-n", "2"], module="mlxdist.bench")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["batch"] for row in rows] == [1, 2]
    for row in rows:
        assert len(row["trials"]["mlxdist"]) == len(row["trials"]["mlx-lm"]) == 2
        ratios = [a / b for a, b in zip(row["trials"]["mlxdist"], row["trials"]["mlx-lm"])]
        assert row["round_ratios"] == ratios
        assert math.isclose(row["mlxdist_over_mlx_lm"], statistics.median(ratios))
    assert "mlx-lm with logprobs" in rows[1] and "mlx-lm with logprobs" not in rows[0]


def test_bench_placement_side_by_side(checkpoint):
    """Even, balanced and balanced + replicas in one run on a router-skewed
    checkpoint: every row has its measured and predicted imbalance, and the
    balanced placements are predicted better than even."""
    path = checkpoint("gpt_oss", router_skew=1.0, skew_order="clustered")
    r = launch(2, ["--model", path, "-p", "16", "-g", "4", "-b", "4", "-n", "1", "--warmup-tokens", "2",
                   "--record-tokens", "8", "--duplicates", "1", "--json"], module="mlxdist.bench.placement")
    assert r.returncode == 0, r.stderr[-3000:]
    report = last_json(r.stdout)
    rows = {row["placement"]: row for row in report["results"]}
    assert set(rows) == {"even", "balanced", "balanced+1d"}
    for row in rows.values():
        assert 0.0 <= row["imbalance"] <= 1.0 and row["generation_tps"] > 0 and row["vs_even"] > 0
    assert rows["even"]["predicted_imbalance"] == report["even_imbalance_predicted"] > 0.2
    assert rows["balanced"]["predicted_imbalance"] < rows["even"]["predicted_imbalance"]
    assert rows["balanced+1d"]["experts_per_rank"] > rows["even"]["experts_per_rank"]


def test_bench_serve_starts_each_contender_as_named():
    from mlxdist.bench.serve import parse_args, server_command

    args = parse_args(["--model", "M", "--mode", "collective,dp", "--rebalance-every", "5"])
    assert server_command("mlx-lm server", args, 9000, 8)[1:5] == ["-m", "mlx_lm", "server", "--model"]
    plain = server_command("mlxdist serve N=2 dp", args, 9000, 8)
    assert plain[plain.index("--mode") + 1] == "dp" and "--rebalance-every" not in plain
    placed = server_command("mlxdist serve N=2 collective rebalancing", args, 9000, 8)
    assert placed[placed.index("--mode") + 1] == "collective"
    assert placed[placed.index("--rebalance-every") + 1] == "5.0" and "--rebalance-duplicates" in placed


def test_compare_ratios_pair_each_round():
    """A ratio is the median of the rounds' ratios (each round's contenders ran
    back to back), not a ratio of medians over separate rounds."""
    from mlxdist.bench.compare import add_ratios

    mine = {"contender": "mlxdist auto", "ranks": 2, "batch": 8, "generation_tps": 20.0,
            "rounds_generation_tps": {0: 10.0, 1: 30.0, 2: 20.0}}
    tensor = {"contender": "mlx-lm tensor", "ranks": 2, "batch": 8, "generation_tps": 10.0,
              "rounds_generation_tps": {0: 10.0, 1: 10.0, 2: 40.0}}
    add_ratios([mine, tensor])
    assert mine["vs_tensor"] == 1.0 and mine["vs_tensor_rounds"] == [1.0, 3.0, 0.5]  # medians' ratio: 2.0
    assert mine["vs_single"] is None and mine["vs_single_rounds"] == []


def test_compare_launches_one_mlxdist_contender_per_expert_split():
    """--expert-split whole,width,auto: three mlxdist launches in each round,
    named after their cut, each passing it (and --replicate) on; none: one
    launch with mlxdist's default. A cut twice or unknown is refused."""
    from mlxdist.bench.compare import contenders, parse_args

    args = parse_args(["--ranks", "2", "--expert-split", "whole,width,auto", "--replicate", "never"])
    launches = [c for c in contenders(args.ranks, args.mode, splits=args.expert_split, replicate=args.replicate)
                if c["name"].startswith("mlxdist")]
    assert [c["name"] for c in launches] == ["mlxdist whole", "mlxdist width", "mlxdist auto"]
    for c, split in zip(launches, ("whole", "width", "auto")):
        extra = c["extra"]
        assert extra[extra.index("--expert-split") + 1] == split and extra[extra.index("--replicate") + 1] == "never"
    plain = [c for c in contenders([2], ["auto"]) if c["name"].startswith("mlxdist")]
    assert [c["name"] for c in plain] == ["mlxdist"] and "--expert-split" not in plain[0]["extra"]
    for bad in ("whole,whole", "sideways"):
        with pytest.raises(SystemExit):
            parse_args(["--expert-split", bad])


def test_replicas_start_each_generation_together(tmp_path):
    """mlx-lm's instances are timed as one job: a process that arrives late
    holds the others at the start line, so their timed generations overlap."""
    import subprocess
    import sys
    import time

    from mlxdist.bench.mlxlm import StartLine

    code = ("import sys, time; from mlxdist.bench.mlxlm import StartLine; "
            "time.sleep(float(sys.argv[2])); line = StartLine.parse(sys.argv[1]); "
            "[(line(), print(time.time(), flush=True)) for _ in range(3)]")
    began = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", code, f"{tmp_path},{i},2", str(delay)], stdout=subprocess.PIPE,
                              text=True, cwd=ROOT) for i, delay in enumerate((0.0, 1.5))]
    passed = [[float(t) for t in p.communicate(timeout=60)[0].split()] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(passed[0]) == len(passed[1]) == 3
    assert passed[0][0] - began >= 1.5  # the early one waited for the late one
    assert all(abs(a - b) < 0.5 for a, b in zip(*passed))
    (tmp_path / "alone").mkdir()
    with pytest.raises(TimeoutError, match="never reached generation 1"):
        StartLine(str(tmp_path / "alone"), 0, 2)(timeout=0.05)
