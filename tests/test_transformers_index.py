"""tests/startup/transformers_index.py, the suite's start-up measure: the
index transformers builds of its model folders at import, kept and read
back, is the index its own scan builds; the first process writes it, later
ones read it; a damaged file is scanned again and rewritten; a model file
edited in place is a miss; MLXDIST_TEST_TRANSFORMERS_INDEX=0 leaves
transformers alone, and so does mlxdist itself (it installs nothing)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, STARTUP

# In a fresh process: import mlxdist, then transformers' tokenizers as mlx-lm
# does; print whether the scan is the cached one, the finders of mlxdist's or
# the suite's on sys.meta_path, and a digest of the index transformers built
# its lazy module from.
CHECK = r"""
import hashlib, json, sys, mlxdist
from mlx_lm import tokenizer_utils
from transformers import AutoTokenizer
import transformers.utils.import_utils as iu
sys.path.insert(0, sys.argv[1])
from transformers_index import encode
index = iu.define_import_structure(__import__("pathlib").Path(iu.__file__).parents[1] / "models", prefix="models")
print(json.dumps({"wrapped": iu.create_import_structure_from_path.__name__ == "scan_cached",
                  "finders": sorted({type(f).__module__ for f in sys.meta_path
                                     if type(f).__module__.split(".")[0] in ("mlxdist", "transformers_index")}),
                  "index": hashlib.sha256(json.dumps(encode(index)).encode()).hexdigest(),
                  "tokenizer": AutoTokenizer.__name__}))
"""


def run(cache, startup=True, **env):
    """CHECK in a fresh process, with tests/startup on PYTHONPATH where ``startup``."""
    path = os.pathsep.join([STARTUP, str(ROOT)] if startup else [str(ROOT)])
    proc = subprocess.run([sys.executable, "-c", CHECK, STARTUP], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(cache), "PYTHONPATH": path,
                                            "MLXDIST_TEST_TRANSFORMERS_INDEX": str(cache / "index"), **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_kept_index_is_transformers_own(tmp_path):
    scanned = run(tmp_path, MLXDIST_TEST_TRANSFORMERS_INDEX="0")
    first = run(tmp_path)
    files = sorted((tmp_path / "index").glob("*.json"))
    assert first == {**scanned, "wrapped": True, "finders": ["transformers_index"]} and files
    stamps = {f: f.stat().st_mtime_ns for f in files}
    assert run(tmp_path) == first  # read back, not written again
    assert {f: f.stat().st_mtime_ns for f in files} == stamps
    for f in files:  # damaged: scanned again, rewritten, still equal
        f.write_text('{"dict": [["x"')
    assert run(tmp_path) == first
    assert all(json.loads(f.read_text()) for f in files)


def test_off_leaves_transformers_alone(tmp_path):
    assert run(tmp_path, MLXDIST_TEST_TRANSFORMERS_INDEX="0")["wrapped"] is False
    assert not (tmp_path / "index").exists()


def test_mlxdist_leaves_transformers_and_the_import_system_alone(tmp_path):
    """Without the suite's start-up folder: import mlxdist and mlx-lm, and
    transformers scans as it was written, with no finder of mlxdist's."""
    got = run(tmp_path, startup=False)
    assert got["wrapped"] is False and got["finders"] == [], got
    assert not (tmp_path / "index").exists()


def test_a_model_file_edited_in_place_is_a_miss(tmp_path):
    """Its own modification time changes, its folder's does not."""
    from transformers_index import _key

    model = tmp_path / "models" / "albert"
    model.mkdir(parents=True)
    source = model / "modeling_albert.py"
    source.write_text("class AlbertModel: pass\n")
    os.utime(source, ns=(1, 1))
    stamp = os.stat(model).st_mtime_ns
    key = _key(tmp_path / "models", "5.0")
    assert key and _key(tmp_path / "models", "5.0") == key
    source.write_text("class AlbertModel: pass\nclass AlbertNew: pass\n")
    os.utime(model, ns=(stamp, stamp))
    assert _key(tmp_path / "models", "5.0") != key
    assert _key(tmp_path / "models", "5.1") != _key(tmp_path / "models", "5.0")


def test_the_encoding_round_trips_and_refuses_other_shapes():
    from transformers_index import decode, encode

    index = {"albert": {frozenset({"tokenizers"}): {"tokenization_albert_fast": {"AlbertTokenizer"}}},
             frozenset(): {"configuration_x": {"XConfig", "YConfig"}}}
    assert decode(json.loads(json.dumps(encode(index)))) == index
    with pytest.raises(TypeError):
        encode({"a": [1]})
    with pytest.raises(KeyError):
        decode({"code": "rm -rf"})
