"""Where a checkpoint's files are and what they hold, before any tensor is
read: a local folder or a hub id fetched into the hub cache
(``resolve_model_path``), a readable ``config.json`` (``check_config``), and
where each tensor's bytes lie, from the headers of the safetensors files
(``read_safetensors_index``; each header read by ``fingerprint.header_bytes``,
its length capped). Shipping reads these to find the model and the byte
ranges each rank needs; ``model/checkpoint.py`` reads tensors at them.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

from mlxdist.errors import CheckpointError, ModelNotFound, one_line
from mlxdist.ship.fingerprint import header_bytes


def resolve_model_path(model: str, revision: Optional[str] = None) -> Path:
    """A local folder, or a hub id (at ``revision``: a branch, tag or
    commit; None: main) fetched into the hub cache by mlx-lm's own
    resolution (its file patterns)."""
    from mlxdist.compat import download as _download

    path = Path(model).expanduser()
    if path.exists():
        if revision is not None:
            raise ModelNotFound(f"--revision is for hub ids; {path} is a local folder")
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} has no config.json: not an mlx-lm model folder")
        return path
    if not is_hub_id(model):
        raise ModelNotFound(f"model path {model} does not exist")
    try:
        return _download(model, revision=revision)
    except Exception as e:
        raise ModelNotFound(f"cannot fetch {model!r} from the Hugging Face hub: {_hub_reason(e, revision)}") from None


def _hub_reason(e: Exception, revision: Optional[str]) -> str:
    """Why a hub download failed, in a few words: the hub's own message for a
    missing repo or revision begins with a bare "404 Client Error."."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(e, GatedRepoError):
        return "the repo is gated: accept its terms on the hub, then log in (hf auth login)"
    if isinstance(e, RepositoryNotFoundError):
        return "the hub has no such repo, or it is private (log in with hf auth login)"
    if isinstance(e, RevisionNotFoundError):
        return f"the repo has no revision {revision or 'main'!r}"
    return one_line(e)


def is_hub_id(model: str) -> bool:
    """Whether ``model``, not found as a folder, reads as a hub id ("org/name")."""
    return not model.startswith((".", "/", "~")) and model.count("/") == 1


def check_config(path: Path) -> None:
    """Raise ``CheckpointError`` unless ``config.json`` is JSON."""
    try:
        json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / 'config.json'} is not valid JSON ({e})") from None


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str
    shape: Tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in the file
    nbytes: int = 0  # bytes of the tensor's data

    @property
    def end(self) -> int:
        """The absolute byte offset just past the tensor's data."""
        return self.offset + self.nbytes


def read_safetensors_index(model_path: Path) -> Dict[str, TensorEntry]:
    """Name -> where its bytes are, from the headers of every weight file."""
    entries = {}
    for file in sorted(model_path.glob("model*.safetensors")):
        head = header_bytes(file)  # its length capped, its bytes all there
        try:
            header = json.loads(head[8:])
            if not isinstance(header, dict):
                raise ValueError(f"a JSON {type(header).__name__} where the header's object should be")
            size = file.stat().st_size
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                start, end = info["data_offsets"]
                if len(head) + end > size:
                    raise CheckpointError(f"{file} is truncated (tensor {name} ends past the file)")
                entries[name] = TensorEntry(file, info["dtype"], tuple(info["shape"]), len(head) + start, end - start)
        except (OSError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError and UnicodeDecodeError among them
            raise CheckpointError(f"{file} is not a valid safetensors file ({one_line(e)})") from None
    return entries
