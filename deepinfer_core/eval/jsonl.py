"""JSONL files written one complete record at a time, readable after a crash.

A record is one line, written with a single ``write`` and then flushed and fsynced, so a killed
writer leaves at most one torn last line (no trailing newline). Readers drop that line; a bad line
anywhere else is corruption and an error naming the file and line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any


def read_jsonl(path: Path, what: str = "record") -> list[dict[str, Any]]:
    """Every complete record of ``path`` (a torn last line is ignored)."""
    records, _ = _scan(Path(path), what)
    return records


def _scan(path: Path, what: str) -> tuple[list[dict[str, Any]], int]:
    """(records, byte length of the complete lines)."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1  # everything after the last newline is a torn write
    records = []
    for lineno, line in enumerate(data[:end].split(b"\n")[:-1], start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not a JSON {what}: {exc.msg}") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{lineno}: a {what} must be a JSON object, got {type(rec).__name__}")
        records.append(rec)
    return records, end


def open_for_append(path: Path, what: str = "record") -> tuple[IO[str], list[dict[str, Any]], int]:
    """Open ``path`` to append records after its complete ones.

    Returns (file, existing records, bytes of a torn last line that were cut off). A missing file
    is created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        return open(path, "a", encoding="utf-8"), [], 0
    records, end = _scan(path, what)
    torn = path.stat().st_size - end
    if torn:
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    return open(path, "a", encoding="utf-8"), records, torn


def append_record(f: IO[str], record: dict[str, Any]) -> None:
    """Append one record as one line and make it durable before returning."""
    f.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")
    f.flush()
    os.fsync(f.fileno())


def write_jsonl_atomic(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace ``path`` with ``records`` all at once (a temporary file renamed over it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, doc: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
