"""Reading and writing the versioned JSON file formats with one-line errors.

Every file format is a pydantic model with ``format`` and ``version`` fields. Reading checks
those first so a wrong file type is reported as such rather than as a pile of field errors.
Writing goes through a temporary file so an interrupted write never leaves a corrupt file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from ..errors import ZbError

__all__ = ["read_json", "parse_model", "read_model", "write_model", "write_text", "validation_message"]

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
    return parse_model(cls, read_json(path), str(Path(path)))


def write_model(model: BaseModel, path: str | os.PathLike) -> Path:
    return write_text(path, model.model_dump_json(indent=1, exclude_none=False) + "\n")


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write through a temporary file and rename, so a failed write leaves no partial file."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    except OSError as err:
        raise ZbError(f"{p}: cannot write ({err.strerror})") from None
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, p)
    except IsADirectoryError:
        Path(tmp).unlink(missing_ok=True)
        raise ZbError(f"{p}: is a directory") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p
