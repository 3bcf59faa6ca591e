"""auto's stored decision (decide/decision.py): the file read back exactly,
every damaged or hostile file refused with a reason (never an exception),
the key, and --exact's checks; then, under mpirun, the default launched
twice with one seed (the second reuses the decision: the same text), and
the API's loads with remeasure, hostile files and exact."""

import json
import math
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from mlxdist.bench.linkemu import EmulatedLink, link_env
from mlxdist.config import LoadOptions
from mlxdist.decide import decision, rule, traffic
from mlxdist.decide.linkcost import AutoInputs, DenseCost, LinkCost
from mlxdist.decide.splitcost import ExpertWork, choose_split
from mlxdist.errors import UserError

from conftest import ROOT, last_json, launch

SHAPE = traffic.Shape(hidden=64, top_k=4, layers=3, moe_layers=3, itemsize=4)
INPUTS = AutoInputs(LinkCost(2.6474500003814683e-05, 3.2025904199693167e-10),
                    DenseCost(9.871828568261012e-05, 9.424871429278678e-05, 0.6776470588235294), SHAPE,
                    2.1793919997221294e-05)
KEY = "0123456789abcdef0123456789abcdef"


def split_choice():
    work = ExpertWork({cut: {b: 1e-5 * b * (1.3 if cut == "width" else 1.0) for b in (1, 4, 8, 32)}
                       for cut in ("whole", "width")})
    return choose_split(INPUTS, work, 2, "mpi", True)


def stored(inputs=INPUTS, split=None) -> dict:
    """A decision file's body as ``settle`` writes it, through JSON."""
    body = {"version": decision.VERSION, "key": KEY, "decided_at": "2026-12-03T00:00:00Z",
            "inputs": decision._inputs_json(inputs), "split": decision._split_json(split)}
    return json.loads(json.dumps(body))


def test_a_decision_reads_back_bit_for_bit():
    split = split_choice()
    inputs, back = decision.parse(stored(INPUTS, split), KEY)
    assert inputs == INPUTS  # every float as measured: the same choices at every batch
    assert back == split and back.describe() == split.describe()
    for b in (1, 2, 3, 4, 8, 32, 64):
        loaded = ["collective", "collective-tp", "replicas"]
        assert (rule.auto_choice(loaded, b, 2, "mpi", "whole", inputs)
                == rule.auto_choice(loaded, b, 2, "mpi", "whole", INPUTS))


def hostile_bodies():
    good = stored(INPUTS, split_choice())
    link_nan = json.loads(json.dumps(good))
    link_nan["inputs"]["link"]["latency"] = float("nan")
    cases = {
        "a list": [],
        "no version": {k: v for k, v in good.items() if k != "version"},
        "another key": {**good, "key": "f" * 32},
        "nothing decided": {**good, "inputs": None, "split": None},
        "NaN latency": link_nan,
        "negative": _with(good, ["inputs", "dense", "fixed"], -1.0),
        "huge": _with(good, ["inputs", "link", "seconds_per_byte"], 1e300),
        "a string": _with(good, ["inputs", "link", "latency"], "26e-6"),
        "a bool": _with(good, ["inputs", "shape", "hidden"], True),
        "shape zero": _with(good, ["inputs", "shape", "top_k"], 0),
        "share above 1": _with(good, ["inputs", "dense", "split"], 1.5),
        "link not an object": _with(good, ["inputs", "link"], [1, 2]),
        "a cut unknown": _with(good, ["split", "split"], "sideways"),
        "a strategy unknown": _with(good, ["split", "strategies", "whole", "1"], "os.system"),
        "a batch missing": _without(good, ["split", "steps", "width", "32"]),
        "steps not an object": _with(good, ["split", "steps", "whole"], 3),
        "worst of another batch": _with(good, ["split", "worst", "whole"], [1.0, 5]),
    }
    return cases


def _with(body, path, value):
    body = json.loads(json.dumps(body))
    node = body
    for name in path[:-1]:
        node = node[name]
    node[path[-1]] = value
    return body


def _without(body, path):
    body = json.loads(json.dumps(body))
    node = body
    for name in path[:-1]:
        node = node[name]
    del node[path[-1]]
    return body


@pytest.mark.parametrize("name", list(hostile_bodies()))
def test_a_hostile_decision_is_refused_with_a_reason(name):
    with pytest.raises(ValueError) as refused:
        decision.parse(hostile_bodies()[name], KEY)
    assert str(refused.value) and "\n" not in str(refused.value)


def test_files_that_are_not_decisions_are_refused_without_reading_them_whole(tmp_path):
    cases = {
        "garbage.json": b"\x00\xff{not json",
        "truncated.json": json.dumps(stored()).encode()[:40],
        "deep.json": b"[" * 100000 + b"]" * 100000,
        "large.json": b" " * (decision.MAX_BYTES + 1),
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        body, why = decision._read(tmp_path / name)
        assert body is None and why, name
    os.mkfifo(tmp_path / "fifo.json")  # opening it would wait for a writer
    os.mkdir(tmp_path / "dir.json")
    for name in ("fifo.json", "dir.json"):
        assert decision._read(tmp_path / name) == (None, "not a regular file")
    assert decision._read(tmp_path / "absent.json") == (None, None)
    (tmp_path / "good.json").write_text(json.dumps(stored()))
    assert decision._read(tmp_path / "good.json") == (stored(), None)


def test_the_key_is_the_model_the_hosts_and_the_link():
    options = LoadOptions("/a/model")
    args = dict(digests={"model.safetensors": "d1"}, revision=None, placement={"layers": {}}, hosts=["a", "b"],
                backend="mpi", device="mpi on Device(cpu, 0)", libraries="mlx 0.32.4, mlx-lm 0.32.2")
    key = decision.decision_key(options, **args)
    assert len(key) == 32 and int(key, 16) >= 0
    # the model's path, --remeasure and --stats do not decide anything auto chooses from
    same = [replace(options, model="/elsewhere"), replace(options, remeasure=True), replace(options, stats=True)]
    assert {decision.decision_key(o, **args) for o in same} == {key}
    others = [dict(args, digests={"model.safetensors": "d2"}), dict(args, hosts=["a", "c"]),
              dict(args, hosts=["a", "b", "c"]), dict(args, backend="ring"), dict(args, revision="v2"),
              dict(args, libraries="mlx 0.33.0, mlx-lm 0.32.2")]
    keys = {decision.decision_key(options, **o) for o in others}
    keys |= {decision.decision_key(replace(options, replicate="never"), **args),
             decision.decision_key(replace(options, layout="compact"), **args)}
    assert key not in keys and len(keys) == len(others) + 2


def test_an_unwritable_store_costs_a_warning_not_the_load(tmp_path, capfd):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert decision._write(blocker / "decisions" / "k.json", {"version": 1}) is False
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mlxdist: warning: cannot store auto's decision")
    assert decision._write(tmp_path / "decisions" / "k.json", {"version": 1})
    assert json.loads((tmp_path / "decisions" / "k.json").read_text()) == {"version": 1}
    assert [p.name for p in (tmp_path / "decisions").iterdir()] == ["k.json"]  # no temporary left


@pytest.mark.parametrize("dispatch", ["auto", "collective", "p2p"])
def test_exact_runs_where_every_batch_can_be_exact(dispatch):
    options = LoadOptions("m", mode=dispatch, exact=True)
    options.validate()
    assert not options.may_replicate and not options.may_cut_in_width
    assert rule.modes_to_load(dispatch, False, "mpi", True, everywhere=False, exact=True) == [
        "collective" if dispatch == "auto" else dispatch]


@pytest.mark.parametrize("options, refusal", [
    (dict(mode="dp"), "--exact keeps every batch bit-exact: it runs with --mode auto, collective, p2p, not dp"),
    (dict(mode="collective-tp"), "not collective-tp"),
    (dict(expert_split="width"), "--exact needs whole experts"),
    (dict(replicate="always"), "it takes no --replicate always"),
    (dict(exact="yes"), "exact and remeasure take true or false"),
    (dict(exact=False, remeasure=1), "exact and remeasure take true or false"),
])
def test_exact_refuses_what_is_not_exact_in_one_line(options, refusal):
    with pytest.raises(UserError) as refused:
        LoadOptions("m", **{"exact": True, **options}).validate()
    assert refusal in str(refused.value) and "\n" not in str(refused.value)


def test_an_expert_slot_out_of_range_is_refused():
    for value in (float("inf"), -1e-9, 1e7):
        with pytest.raises(ValueError):
            decision.parse(_with(stored(), ["inputs", "expert_slot"], value), KEY)
    assert math.isfinite(decision.parse(stored(), KEY)[0].expert_slot)


# -- under mpirun: two launches of the default, then one of the API -----------------------------

CHOSE = re.compile(r"auto: b = 1 on 2 ranks runs ([\w-]+);")
WARNING = "mlxdist: warning: ignoring the stored auto decision "
SLOW = EmulatedLink("slow", 50000, 1000)  # 50 ms a collective: measured, auto would run one prompt otherwise


def run_default(path, cache, link=None):
    """One launch of the default (auto, --replicate auto, --expert-split
    auto) on two ranks: one sampled prompt, as JSON, with auto's lines."""
    args = ["--model", path, "-p", "Hello there", "-m", 8, "--temp", 1, "--seed", 3, "--json", "--quiet", "--verbose"]
    proc = launch(2, args, env={"MLXDIST_CACHE": str(cache), "MLXDIST_AUTO_LINK": "measure", "MLXDIST_REMEASURE": "0",
                                    **link_env(link)},
                  timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    chose = CHOSE.findall(proc.stderr)
    assert len(chose) == 1, proc.stderr[-3000:]
    return last_json(proc.stdout), chose[0], proc.stderr


def test_the_default_decides_once_and_gives_the_same_text_after_a_restart(checkpoint, tmp_path):
    """The second launch runs under a link 2,000 times slower, on which auto
    would choose otherwise for one prompt: it reuses the stored decision
    (said in --json, and under --verbose), so the same seed gives the same
    text. A third launch, of the API, reuses it too, and every rank reports
    rank 0's; remeasure and every hostile file are measured again with one
    warning line each; exact runs collective at b = 4."""
    path = checkpoint("qwen3_moe")
    first, chose_first, _ = run_default(path, tmp_path)
    decided = first["auto_decision"]
    assert decided["source"] == "measured" and Path(decided["file"]).is_file()
    assert Path(decided["file"]).parent == tmp_path / "decisions"
    second, chose_second, stderr = run_default(path, tmp_path, SLOW)
    again = second["auto_decision"]
    assert again["source"] == "stored" and again["key"] == decided["key"] and again["file"] == decided["file"]
    assert again["inputs"] == decided["inputs"] and again["decided_at"] == decided["decided_at"]
    assert f"auto: decision stored ({decided['file']};" in stderr
    assert chose_second == chose_first
    assert (second["tokens"], second["text"]) == (first["tokens"], first["text"])

    proc = launch(2, [ROOT / "tests/scripts/decision_each.py", path], module=None, timeout=300,
                  env={"MLXDIST_CACHE": str(tmp_path), "MLXDIST_AUTO_LINK": "measure", "MLXDIST_REMEASURE": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    loads = out["loads"]
    assert [l["source"] for l in loads] == ["stored"] + ["measured"] * 6 + ["fixed"]
    assert loads[0]["inputs"] == decided["inputs"] and {l["key"] for l in loads[:7]} == {decided["key"]}
    assert out["stats"] == [out["stats"][0]] * 2 and out["stats"][0]["source"] == "stored"  # rank 0's on every rank
    assert loads[6]["file"] is None  # a folder in its place: nothing stored, the load goes on
    warnings = [l for l in proc.stderr.splitlines() if l.startswith("mlxdist: warning:")]
    ignored = [w for w in warnings if w.startswith(WARNING)]  # three hostile files, other shapes, a folder
    assert len(ignored) == 5 and "made for other shapes" in ignored[3], warnings
    assert len(warnings) == 6 and "cannot store auto's decision" in warnings[-1], warnings
    assert "Traceback" not in proc.stderr
    assert loads[7]["strategies"] == ["collective"] and out["exact_strategy"] == "collective"
    assert out["refused"].startswith("--exact keeps every batch bit-exact")
    assert out["rewritten"] == [True] * 3
