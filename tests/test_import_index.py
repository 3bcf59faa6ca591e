"""import_index.py: the index transformers builds of its model
folders at import, kept and read back, is the index its own scan builds;
the first process writes it, later ones read it; a damaged file is scanned
again and rewritten; MLXDIST_TRANSFORMERS_INDEX=0 leaves transformers alone."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT

# In a fresh process: import mlxdist (which installs the finder), then
# transformers' tokenizers as mlx-lm does; print whether the scan is the
# cached one, and a digest of the index transformers built its lazy module from.
CHECK = r"""
import hashlib, json, mlxdist
from mlx_lm import tokenizer_utils
from transformers import AutoTokenizer
import transformers.utils.import_utils as iu
from mlxdist.import_index import encode
index = iu.define_import_structure(__import__("pathlib").Path(iu.__file__).parents[1] / "models", prefix="models")
print(json.dumps({"wrapped": iu.create_import_structure_from_path.__name__ == "scan_cached",
                  "index": hashlib.sha256(json.dumps(encode(index)).encode()).hexdigest(),
                  "tokenizer": AutoTokenizer.__name__}))
"""


def run(cache, **env):
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(cache), "MLXDIST_CACHE": str(cache), **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_kept_index_is_transformers_own(tmp_path):
    scanned = run(tmp_path, MLXDIST_TRANSFORMERS_INDEX="0")
    first = run(tmp_path)
    files = sorted((tmp_path / "transformers-index").glob("*.json"))
    assert first == {**scanned, "wrapped": True} and files
    stamps = {f: f.stat().st_mtime_ns for f in files}
    assert run(tmp_path) == first  # read back, not written again
    assert {f: f.stat().st_mtime_ns for f in files} == stamps
    for f in files:  # damaged: scanned again, rewritten, still equal
        f.write_text('{"dict": [["x"')
    assert run(tmp_path) == first
    assert all(json.loads(f.read_text()) for f in files)


def test_off_leaves_transformers_alone(tmp_path):
    assert run(tmp_path, MLXDIST_TRANSFORMERS_INDEX="0")["wrapped"] is False
    assert not (tmp_path / "transformers-index").exists()


def test_the_encoding_round_trips_and_refuses_other_shapes():
    from mlxdist.import_index import decode, encode

    index = {"albert": {frozenset({"tokenizers"}): {"tokenization_albert_fast": {"AlbertTokenizer"}}},
             frozenset(): {"configuration_x": {"XConfig", "YConfig"}}}
    assert decode(json.loads(json.dumps(encode(index)))) == index
    with pytest.raises(TypeError):
        encode({"a": [1]})
    with pytest.raises(KeyError):
        decode({"code": "rm -rf"})
