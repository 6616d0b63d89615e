"""Data files -> ``Record``s: reading ``.jsonl`` / ``.parquet`` files for ``relax.data.prompts``.

Every row keeps where it came from (``Record.file`` / ``Record.row``) so that an error about it,
here or later in ``relax.data.prompts``, names the file and the 1-based row (the line number for
jsonl). jsonl files must be UTF-8: an invalid byte raises naming its line, column and byte
offset. A byte-order mark at the start of a file is skipped; lines may end in LF, CRLF or CR.
Each line is parsed within ``relax.models.hf.bounded_json``'s bounds: nesting deeper than 128
arrays/objects, NaN/Infinity, a number beyond float64 or an integer of over 4,300 digits raises
``ValueError`` naming the file, line and column (never a bare ``RecursionError``).
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from relax.models.hf.bounded_json import JSONLimitError, loads

PathLike = str | os.PathLike[str]
SUFFIXES = (".jsonl", ".parquet")
RECORDS_LABEL = "<records>"  # the "file" of rows given to ``prompt_batch`` as plain dicts
# Opening jsonl files: an invalid UTF-8 byte decodes to one lone surrogate U+DC80..U+DCFF (found
# per line, ``_BAD_BYTE``) instead of failing a whole read chunk with no line to name; newline=""
# keeps line endings, so each line's byte length is known (for the offset of a bad byte).
_JSONL_OPEN = {"encoding": "utf-8-sig", "errors": "surrogateescape", "newline": ""}
_BAD_BYTE = re.compile("[\udc80-\udcff]")


class MissingFieldError(KeyError):
    """A row lacks a required field; the message names the file, the row and the field."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


@dataclasses.dataclass(frozen=True)
class Record:
    """One data row and where it came from, so that errors can name it.

    ``file``: the data file (``"<records>"`` for rows given to ``prompt_batch`` as plain dicts);
    ``row``: 1-based, the line number for jsonl, the row number for parquet (the index in the
    list for plain dicts); ``record``: the row's columns.
    """

    file: str
    row: int
    record: dict[str, Any]


# ------------------------------------------------------------------------------- reading


def resolve_files(path: PathLike | Sequence[PathLike]) -> list[Path]:
    """The data files ``path`` names: a file, a directory's jsonl/parquet files, or a list."""
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not paths:
        raise ValueError("no data path given")
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix in SUFFIXES and f.is_file())
            if not found:
                raise FileNotFoundError(f"directory {p} holds no .jsonl or .parquet file")
            files += found
        elif not p.is_file():
            raise FileNotFoundError(f"data file not found: {p}")
        elif p.suffix not in SUFFIXES:
            raise ValueError(f"{p}: unsupported data file type {p.suffix!r} (.jsonl or .parquet)")
        else:
            files.append(p)
    return files


def _read_jsonl(file: Path) -> list[Record]:
    """The JSON object on each non-blank line of ``file``; errors name the file and line.

    The file must be UTF-8: an invalid byte raises ``ValueError`` with its line, column and
    byte offset. A byte-order mark at the start is skipped; lines may end in LF, CRLF or CR.
    """
    rows = []
    with open(file, **_JSONL_OPEN) as f:
        for lineno, line in enumerate(f, start=1):
            bad = None if line.isascii() else _BAD_BYTE.search(line)
            if bad is not None:
                raise _invalid_utf8(file, lineno, line, bad.start())
            if not line.strip():
                continue
            try:
                record = loads(line.rstrip("\r\n"))  # columns counted on the line itself
            except json.JSONDecodeError as e:
                what = (
                    "JSON beyond relax's bounds"
                    if isinstance(e, JSONLimitError)
                    else "invalid JSON"
                )
                msg = f"{file}: line {lineno}: {what}: {e.msg} (column {e.colno})"
                raise ValueError(msg) from None
            if not isinstance(record, dict):
                kind = type(record).__name__
                raise ValueError(f"{file}: line {lineno}: expected a JSON object, got {kind}")
            rows.append(Record(str(file), lineno, record))
    return rows


def _invalid_utf8(file: Path, lineno: int, line: str, index: int) -> ValueError:
    """The error for the invalid byte at ``line[index]`` (a surrogate-escaped byte)."""
    byte = ord(line[index]) - 0xDC00
    offset = _line_start(file, lineno) + len(line[:index].encode("utf-8", "surrogateescape"))
    return ValueError(
        f"{file}: line {lineno}: invalid UTF-8 byte 0x{byte:02x} at column {index + 1} "
        f"(byte offset {offset} in the file); jsonl data files must be UTF-8 encoded"
    )


def _line_start(file: Path, lineno: int) -> int:
    """The byte offset in ``file`` at which (1-based) line ``lineno`` starts."""
    with open(file, "rb") as f:
        offset = len(codecs.BOM_UTF8) if f.read(3) == codecs.BOM_UTF8 else 0
    with open(file, **_JSONL_OPEN) as f:
        for _, line in zip(range(lineno - 1), f):
            offset += len(line.encode("utf-8", "surrogateescape"))
    return offset


def _read_parquet(file: Path) -> list[Record]:
    """Every row of a parquet ``file`` (needs pyarrow); a corrupt file raises naming it."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {file} needs pyarrow: pip install pyarrow") from e
    try:
        records = pq.read_table(file).to_pylist()
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise ValueError(f"{file}: cannot read parquet: {e}") from e
    return [Record(str(file), i, r) for i, r in enumerate(records, start=1)]


def read_records(
    path: PathLike | Sequence[PathLike], *, fields: Sequence[str] = ()
) -> list[Record]:
    """Every row of ``path`` (see ``resolve_files``) as a ``Record``, in file order.

    Each name in ``fields`` must be present in every row; a missing one raises
    ``MissingFieldError`` (a KeyError) naming the file, the 1-based row (jsonl: line number)
    and the field. Blank jsonl lines are skipped; an empty file raises. Give the result to
    ``prompt_batch`` for errors that name the file and row.
    """
    rows = []
    for file in resolve_files(path):
        new = _read_jsonl(file) if file.suffix == ".jsonl" else _read_parquet(file)
        if not new:
            raise ValueError(f"{file}: data file is empty")
        for r in new:
            require_fields(r, fields)
        rows += new
    return rows


def as_record(r: Record | Mapping[str, Any], index: int) -> Record:
    """``r`` itself, or a plain dict labelled ``<records>`` row ``index`` (1-based), so that
    errors about rows given as dicts name them too."""
    if isinstance(r, Record):
        return r
    if not isinstance(r, Mapping):
        raise TypeError(
            f"{RECORDS_LABEL}: row {index}: expected a dict or a Record, got {type(r).__name__}"
        )
    return Record(RECORDS_LABEL, index, dict(r))


def require_fields(r: Record, fields: Sequence[str]) -> None:
    """Raise ``MissingFieldError`` naming the file, row and field if ``r`` lacks a name of ``fields``."""
    for name in fields:
        if name not in r.record:
            msg = f"{r.file}: row {r.row}: missing field {name!r} (row has {sorted(r.record)})"
            raise MissingFieldError(msg)


def load_records(path: PathLike | Sequence[PathLike], *, fields: Sequence[str] = ()) -> list[dict]:
    """Every row of ``path`` as a plain dict: ``read_records`` without the file and row."""
    return [r.record for r in read_records(path, fields=fields)]
