"""Reading and writing the versioned JSON file formats with one-line errors.

Every file format is a pydantic model with ``format`` and ``version`` fields. Reading checks
those first so a wrong file type is reported as such rather than as a pile of field errors.
Writing goes through a temporary file so an interrupted write never leaves a corrupt file, but
only over regular files: what a user points ``-o`` at (a symlink, a FIFO, a device) stays what
it is, and files get the modes any other program would give them.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from ..errors import ZbError

__all__ = [
    "read_json", "parse_model", "read_model", "write_model", "write_text", "write_bytes", "check_writable",
    "validation_message",
]

M = TypeVar("M", bound=BaseModel)


def validation_message(err: ValidationError) -> str:
    """The first pydantic error as ``field.path: message``."""
    first = err.errors()[0]
    loc = ".".join(str(x) for x in first.get("loc", ())) or "(top level)"
    msg = first.get("msg", "invalid").removeprefix("Value error, ")
    more = len(err.errors()) - 1
    return f"{loc}: {msg}" + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


def _check_header(data: object, fmt: str, version: int, where: str) -> None:
    if not isinstance(data, dict):
        raise ZbError(f"{where}: expected a JSON object with format {fmt!r}")
    if data.get("format") != fmt:
        raise ZbError(f"{where}: format is {data.get('format')!r}, expected {fmt!r}")
    if data.get("version") != version:
        raise ZbError(f"{where}: {fmt} version {data.get('version')!r} is not supported (this zbsearch reads version {version})")


def parse_model(cls: type[M], data: object, where: str) -> M:
    """``data`` (parsed JSON) as a ``cls``, checking its format and version first.

    Raises:
        ZbError: another format or version, or the first field error, prefixed by ``where``.
    """
    fields = cls.model_fields
    _check_header(data, fields["format"].default, fields["version"].default, where)
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ZbError(f"{where}: {validation_message(err)}") from None


def read_json(path: str | os.PathLike) -> object:
    """The parsed contents of a JSON file; a missing, unreadable or malformed file is one ZbError line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ZbError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise ZbError(f"{p}: is a directory, expected a JSON file") from None
    except OSError as err:
        raise ZbError(f"{p}: cannot read ({err.strerror})") from None
    except UnicodeDecodeError:
        raise ZbError(f"{p}: not valid JSON (not UTF-8 text)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ZbError(f"{p}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None


def read_model(cls: type[M], path: str | os.PathLike) -> M:
    """The ``cls`` in the JSON file at ``path``; every problem is one ZbError line naming the file."""
    return parse_model(cls, read_json(path), str(Path(path)))


def write_model(model: BaseModel, path: str | os.PathLike) -> Path:
    """Write ``model`` as indented JSON, atomically (``write_bytes``); the path written."""
    return write_text(path, model.model_dump_json(indent=1, exclude_none=False) + "\n")


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` as UTF-8, atomically (``write_bytes``); the path written."""
    return write_bytes(path, text.encode("utf-8"))


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def _target(path: str | os.PathLike) -> Path:
    """Where writing ``path`` lands: symlinks followed (so the link stays a link), '' refused."""
    if str(path) == "":
        raise ZbError("the output path is empty")
    p = Path(path)
    return Path(os.path.realpath(p)) if p.is_symlink() else p


def _existing(p: Path, path: str | os.PathLike) -> os.stat_result | None:
    """What is at the target now (None: nothing); a folder there is an error."""
    try:
        st = p.stat()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ZbError(f"{path}: cannot write ({err.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ZbError(f"{path}: is a directory")
    return st


def check_writable(path: str | os.PathLike) -> Path:
    """Fail now, with one line, if ``write_bytes(path, ...)`` would fail later; the target path.

    Run before long work so its result is not lost to a bad ``-o``. Probes by creating (and
    removing) a temporary file where the atomic write will create one; nothing else is left.
    """
    p = _target(path)
    st = _existing(p, path)
    if st is not None and not stat.S_ISREG(st.st_mode):  # a device or FIFO is written in place
        if not os.access(p, os.W_OK):
            raise ZbError(f"{path}: cannot write (permission denied)")
        return p
    folder = p.parent
    while not folder.exists():  # write_bytes creates missing folders: probe the first that exists
        folder = folder.parent
    if not folder.is_dir():
        raise ZbError(f"{path}: cannot write ({folder} is not a directory)")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".zbsearch-probe.", suffix=".tmp")
    except OSError as err:
        raise ZbError(f"{path}: cannot write ({err.strerror})") from None
    os.close(fd)
    os.unlink(tmp)
    return p


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path``; the path written (a symlink's target). Errors are one ZbError line.

    A regular file (or a new one) is written to a temporary file beside it and renamed over it,
    so a failed or interrupted write leaves the old file or none, never a partial one; the
    result has the old file's mode, or 0666 less the umask like any new file. A symlink is
    followed and its target written that way. Devices and FIFOs are written in place: renaming
    over them would replace the node itself.
    """
    p = _target(path)
    st = _existing(p, path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        try:
            with open(p, "wb") as fh:
                fh.write(data)
        except OSError as err:
            raise ZbError(f"{path}: cannot write ({err.strerror})") from None
        return p
    mode = stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~_umask()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    except OSError as err:
        raise ZbError(f"{path}: cannot write ({err.strerror})") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fchmod(fh.fileno(), mode)
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise ZbError(f"{path}: cannot write ({err.strerror})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p
