"""Reading JSONL input files: every bad line is reported as `file:line`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_jsonl(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(`file:line`, parsed value) for every non-blank line; a line that is not UTF-8 or not JSON is a
    ValueError naming its `file:line` (a UTF-8 byte-order mark before the first line is allowed)."""
    path = Path(path)
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                byte = f"byte 0x{raw[e.start]:02x} at column {e.start + 1}"
                raise ValueError(f"{where}: not valid UTF-8 ({byte})") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            yield where, value
