"""``python -m mlxdist.bench prefill``: one small real run (mlx-lm in one
process and tensor parallel, mlxdist collective, N = 2) whose table's ratios
are the rounds' own, the median and spread over rounds, and hostile options
refused in one line."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, mpirun_env
from mlxdist.bench.prefill import aggregate, format_table, parse_args, ratios


def test_a_run_reports_prompt_tps_and_ratios_from_its_own_rounds(checkpoint, tmp_path):
    model = checkpoint("qwen3_moe")  # float32: mlx-lm can shard it
    proc = subprocess.run([sys.executable, "-m", "mlxdist.bench", "prefill", "--model", str(model), "-p", "300,40",
                           "-n", "2", "--rounds-at", "300:1", "--mode", "collective", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env=mpirun_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "prefill.json").read_text())
    rows = {(r["contender"], r["prompt_tokens"]): r for r in result["results"]}
    assert set(rows) == {(c, n) for c in ("mlx-lm single", "mlx-lm tensor", "mlxdist collective") for n in (300, 40)}
    assert [len(rows[("mlxdist collective", n)]["rounds_prompt_tps"]) for n in (300, 40)] == [1, 2]  # --rounds-at
    for (name, n), row in rows.items():
        assert row["prompt_tps"] > 0 and row["ranks"] == (1 if name == "mlx-lm single" else 2)
        single = rows[("mlx-lm single", n)]["rounds_prompt_tps"]
        assert row["vs_single_rounds"] == [row["rounds_prompt_tps"][k] / single[k] for k in sorted(single)]
    assert rows[("mlxdist collective", 300)]["strategy"] == "collective"
    assert len(result["load_average"]) == 6 and result["versions"]["mlx-lm"]
    assert "| mlxdist collective | 2 |" in proc.stdout and "x one process" in proc.stdout


def test_medians_spread_and_ratios_over_rounds():
    trials = [{"contender": c, "prompt_tokens": 512, "ranks": n, "round": k, "prompt_tps": tps}
              for c, n, values in (("mlx-lm single", 1, [100, 90, 80]), ("mlx-lm tensor", 2, [150, 150, 160]),
                                   ("mlxdist collective", 2, [200, 90, 120]))
              for k, tps in enumerate(values)]
    rows = aggregate(trials)
    ratios(rows, 2)
    ours = next(r for r in rows if r["contender"] == "mlxdist collective")
    assert (ours["prompt_tps"], ours["min_prompt_tps"], ours["max_prompt_tps"]) == (120, 90, 200)
    assert ours["vs_single_rounds"] == [2.0, 1.0, 1.5] and ours["vs_single"] == 1.5
    assert ours["vs_tensor"] == pytest.approx(0.75)
    table = format_table({"prompt_tokens": [512], "results": rows})
    assert "| mlxdist collective | 2 | 120.0 (90.0-200.0): 1.50 x one process, 0.75 x TP |" in table


@pytest.mark.parametrize("argv,says", [
    (["-p", "0"], "at least 1"), (["-p", "512,512"], "distinct"), (["-p", "12x"], "prompt lengths"),
    (["-p", ",".join(map(str, range(1, 20)))], "up to 16"), (["--rounds-at", "512"], "LEN:ROUNDS"),
    (["--rounds-at", "512:0"], "LEN:ROUNDS"), (["--mode", "fast"], "distinct modes"),
    (["--mode", "collective,collective"], "distinct modes"), (["-n", "0"], "at least 1"),
    (["--ranks", "-1"], "--ranks"), (["--timeout", "soon"], "--timeout"),
])
def test_hostile_options_are_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert says in err.strip().splitlines()[-1]
