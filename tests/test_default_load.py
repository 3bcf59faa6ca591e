"""The default dispatch (``auto``) loads and generates wherever ``collective``
does: every MoE model type the installed mlx-lm ships, as a tiny random
checkpoint whose config.json holds only the keys its type reads (as a
published one does), float32 and 4-bit (float32 alone on 3 ranks), and shapes that mlx-lm's tensor
parallelism cannot split (a 4-bit gpt_oss of 16 experts; a 4-bit gpt_oss
whose experts are 6 quantization groups of 32 wide, as gpt-oss-120b's 2,880
are 90: they divide by 2 and 3, not by 4). One launch per world size loads
each checkpoint in turn under the default, generates one prompt and a batch
of a prompt per rank, and loads under ``collective`` only where the default
failed: any error the default has, ``collective`` must have too. On 2 and
4 ranks auto takes one host's link, whose rule runs one sequence split by
tensor parallelism wherever it loaded that split (a measured link may
choose otherwise, and leave a split that fails in the forward untried); on
3, where no tiny model's heads split, the link is measured at load, as a
user's run does (the cost model runs). Where the default cannot
split the model as tensor parallelism does, it runs without that split and
says so in one line."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from mlxdist.synth import TINY_MODELS, TINY_PREFIX, write_checkpoint
from shared_launch import several

MAX_TOKENS = 4
# world size -> the default dispatch with rank 0's MLXDIST_AUTO_LINK (default_each.py)
DEFAULT = {2: "auto:local", 3: "auto:measure", 4: "auto:local"}
# dbrx is refused by every mode (tests/test_models.py)
TYPES = [t for t in sorted(TINY_MODELS) if t != "dbrx"]
# name -> (model type, write_checkpoint's keyword arguments)
SHAPES = {f"{t}-float32": (t, {}) for t in TYPES}
SHAPES.update({f"{t}-4bit": (t, {"quantize_bits": 4}) for t in TYPES})
SHAPES["gpt_oss-16-experts-4bit"] = ("gpt_oss", {"quantize_bits": 4, "overrides": {"num_local_experts": 16}})
SHAPES["gpt_oss-120b-widths-4bit"] = ("gpt_oss", {"quantize_bits": 4, "group_size": 32, "overrides": dict(
    num_attention_heads=8, num_key_value_heads=4, intermediate_size=192)})
FLOAT32 = [n for n in SHAPES if n.endswith("-float32")]
# name -> the world size at which mlx-lm's shard() cannot split it (auto's one line says why)
UNSPLIT = {"gpt_oss-16-experts-4bit": 2, "gpt_oss-120b-widths-4bit": 4}
# world size -> the checkpoints its launch loads: float32 and 4-bit on 2 and 4 ranks (where
# tensor parallelism's cuts of quantized groups are tried), float32 on 3 (where auto measures
# the link at load: the cost model's path, which the bits do not change; half of one of the
# suite's longest launches), the 16-expert gpt_oss on 2 and 3, gpt-oss-120b's widths on 4
# (they divide by 2 and 3)
RUNS = {2: [n for n in SHAPES if "120b" not in n], 3: FLOAT32 + ["gpt_oss-16-experts-4bit"],
        4: [n for n in SHAPES if "16-experts" not in n]}
_KEEP = {"model_type", "quantization", "quantization_config", "text_config"}


def _own_keys(path: Path) -> None:
    """Rewrite ``path``'s config.json with only the keys its model type's
    ``ModelArgs`` reads (synth's tiny configs share one base of every type's
    keys; a published config has its type's own: phixtral's names its width
    ``model_dim``, deepseek_v41's and step3p5's name no key-value heads),
    where mlx-lm still loads the model and its tokenizer from it (a type
    whose arguments are read through another type's, or whose tokenizer's
    config checks the top level, keeps synth's)."""
    from mlx_lm.utils import load_model, load_tokenizer

    from mlxdist.compat import model_classes

    file = path / "config.json"
    written = file.read_text()
    config = json.loads(written)
    _, args_class = model_classes(config)
    known = {f.name for f in dataclasses.fields(args_class)} | _KEEP
    file.write_text(json.dumps({k: v for k, v in config.items() if k in known}, indent=2))
    try:
        load_model(path, lazy=True)
        load_tokenizer(path)
    except Exception:  # noqa: BLE001 - whatever mlx-lm or transformers refuse: synth's config as it was
        file.write_text(written)


def _line(error):
    """An error line without the path of its rank's traceback file (a process id in it)."""
    return error and re.sub(r" \(traceback: [^)]*\)", "", error)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("default-load")
    out = {}
    for name, (model_type, kwargs) in SHAPES.items():
        out[name] = write_checkpoint(root / name, TINY_PREFIX + model_type, **kwargs)
        _own_keys(out[name])
    return out


@pytest.mark.parametrize("nranks", sorted(RUNS))
def test_default_loads_wherever_collective_does(checkpoints, nranks):
    names = RUNS[nranks]
    paths = [checkpoints[n] for n in names]
    (got,) = several(nranks, [("default_each", [MAX_TOKENS, f"{DEFAULT[nranks]},collective", *paths])],
                     timeout=120 + 15 * len(paths))
    worse = {}
    for name, path in zip(names, paths):
        runs = got[str(path)]
        default, collective = runs[DEFAULT[nranks]], runs.get("collective", {})
        for key, error in (("tokens", "error"), ("batch", "batch_error")):
            if error in default and _line(collective.get(error)) != _line(default[error]):
                worse[f"{name} ({key})"] = f"{default[error]} (collective: {collective.get(error, 'runs')})"
        if "tokens" in default:
            assert 0 < len(default["tokens"]) <= MAX_TOKENS, name
        if "batch" in default:
            assert len(default["batch"]) == nranks and all(0 < len(t) <= MAX_TOKENS for t in default["batch"]), name
        if "loaded" in default:
            assert len(default["notes"]) <= 1, (name, default["notes"])
        if "loaded" in default and UNSPLIT.get(name) == nranks:
            assert "collective-tp" not in default["loaded"], name
            assert len(default["notes"]) == 1 and "mlx-lm's shard() of gpt_oss" in default["notes"][0], name
    assert not worse, "\n".join(f"{n}: {e}" for n, e in worse.items())
