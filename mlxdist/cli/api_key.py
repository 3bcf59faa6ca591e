"""The server's bearer token, from ``--api-key``, ``--api-key-file`` or
``MLXDIST_API_KEY``, checked before anything starts: a key a client could
not send back is refused in one line naming where it came from, never taken
for no key.

A key is 1 to ``MAX_KEY_CHARS`` printable ASCII characters without spaces
(what an HTTP ``Authorization: Bearer`` header carries byte for byte). A key
file is a regular file whose first line is the key (surrounding spaces and
the line's end dropped); it is opened without waiting, so a FIFO or a
device is refused rather than read forever.

    api_key(given, path) -> the key (or None: no key anywhere), or UserError
    check_key(key, source) -> the key, or UserError naming ``source``
    read_key_file(path) -> the first line's key, or UserError
"""

import os
import stat
from typing import Optional

from mlxdist import envs
from mlxdist.errors import UserError, one_line

MAX_KEY_CHARS = 4096
_BOM = b"\xef\xbb\xbf"
_SPACE = b" \t\r\n"
_READ = MAX_KEY_CHARS + 256  # bytes of the first line read: the key and the spaces around it


def api_key(given: Optional[str], path: Optional[str]) -> Optional[str]:
    """The key: ``given`` (--api-key), else the first line of ``path``
    (--api-key-file), else ``MLXDIST_API_KEY``, else None. Raises
    ``UserError`` for an empty, blank or unusable one wherever it is given."""
    if given is not None:
        return check_key(given, "--api-key")
    if path is not None:
        return read_key_file(path)
    if envs.is_set("MLXDIST_API_KEY"):
        key = envs.get("MLXDIST_API_KEY")
        if key is None:  # empty or blank: envs reads it as unset
            raise UserError("MLXDIST_API_KEY is set but empty or blank: give a key, or unset it")
        return check_key(key, "MLXDIST_API_KEY")
    return None


def check_key(key: str, source: str) -> str:
    """``key`` as ``source`` gave it, if a client can send it back: 1 to
    ``MAX_KEY_CHARS`` printable ASCII characters without spaces."""
    if not key.strip():
        raise UserError(f"{source} is {'empty' if not key else 'blank'}: give a key, or no {source} at all")
    if len(key) > MAX_KEY_CHARS:
        raise UserError(f"{source} is {len(key)} characters long; a key may have at most {MAX_KEY_CHARS}")
    bad = next((c for c in key if not "!" <= c <= "~"), None)
    if bad is not None:
        raise UserError(f"{source} holds {_name(bad)}: a key is printable ASCII without spaces, which every "
                        f"client can send in an Authorization header")
    return key


def read_key_file(path: str) -> str:
    """The key on the first line of the regular file ``path``."""
    source = f"--api-key-file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, and is refused below
    except OSError as e:
        raise UserError(f"{source}: cannot read it ({one_line(e)})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"{source}: not a regular file (a key file holds the key on its first line)")
    with os.fdopen(fd, "rb") as f:
        try:
            raw = f.readline(_READ)
        except OSError as e:
            raise UserError(f"{source}: cannot read it ({one_line(e)})") from None
    if raw.startswith(_BOM):
        raise UserError(f"{source}: starts with a byte-order mark (U+FEFF): save it as plain ASCII")
    line = raw.strip(_SPACE)
    if len(line) > MAX_KEY_CHARS or (len(raw) == _READ and not raw.endswith(b"\n")):
        raise UserError(f"{source}: its first line is longer than {MAX_KEY_CHARS} characters, the most a key may have")
    if not line:
        raise UserError(f"{source}: its first line is empty")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{source}: its first line is not text (bytes that are not UTF-8)") from None
    return check_key(text, source)


def _name(char: str) -> str:
    if char == " ":
        return "a space"
    if ord(char) < 0x20 or ord(char) == 0x7F:
        return f"a control character (U+{ord(char):04X})"
    return f"a character that is not ASCII (U+{ord(char):04X})"
