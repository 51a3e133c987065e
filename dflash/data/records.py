"""The raw records of a data file, streamed: one per line of a `.jsonl` file, or one per element of a `.json`
file holding an array of records (ShareGPT's own format). An array is decoded piece by piece, never loaded
whole; a file cut off inside the array (a truncated download, a size cap) yields its complete records and then
one error row that gives the byte offset of the cut, counted like a bad record (reason `truncated_file`).

Each row is `(where, raw, error)`: `where` is `file:line` (JSONL) or `file:record N` (array, N from 1), `raw`
the record's bytes (b"" for an error row), `error` "" or "where: why". An array's bytes that are not UTF-8 are
kept as they are (decoded with surrogateescape, encoded back), so its record is refused as `not_utf8` by the one
rule a JSONL line meets (`chat.parse_line`), never trained on as U+FFFD.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path

_CHUNK = 1 << 20  # characters decoded per read
_WS = " \t\r\n"
_BYTES = "surrogateescape"  # a byte that is not UTF-8 stays that byte (a lone surrogate in the text), both ways


def iter_raw_records(path: str | Path) -> Iterator[tuple[str, bytes, str]]:
    path = Path(path)
    if is_json_array(path):
        yield from _array_records(path)
        return
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if raw.strip():
                yield f"{path}:{lineno}", raw.rstrip(b"\r\n"), ""


def is_json_array(path: Path) -> bool:
    """A `.json` file whose first non-blank character is `[`."""
    if path.suffix.lower() != ".json":
        return False
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip(b" \t\r\n\xef\xbb\xbf")
    return head.startswith(b"[")


class _Reader:
    """Text of a file in chunks with the byte offset of the buffer's first character."""

    def __init__(self, fh):
        self.fh, self.decoder = fh, codecs.getincrementaldecoder("utf-8")(errors=_BYTES)
        self.buf, self.base, self.eof = "", 0, False
        if fh.read(3) == codecs.BOM_UTF8:  # skipped, but its bytes count in the offsets
            self.base = 3
        else:
            fh.seek(0)

    def more(self) -> bool:
        if self.eof:
            return False
        chunk = self.fh.read(_CHUNK)
        self.eof = not chunk
        self.buf += self.decoder.decode(chunk, final=self.eof)
        return bool(chunk) or bool(self.buf)

    def consume(self, n: int) -> None:
        self.base += len(self.buf[:n].encode("utf-8", _BYTES))
        self.buf = self.buf[n:]

    def skip_ws(self) -> bool:
        """Drop leading whitespace; False at the end of the file."""
        while True:
            stripped = self.buf.lstrip(_WS)
            self.consume(len(self.buf) - len(stripped))
            if self.buf or not self.more():
                return bool(self.buf)


def _array_records(path: Path) -> Iterator[tuple[str, bytes, str]]:
    decoder = json.JSONDecoder()
    with open(path, "rb") as fh:
        r = _Reader(fh)
        r.skip_ws()
        r.consume(1)  # the '['
        n = 0
        while True:
            if not r.skip_ws():
                yield _cut(path, r.base, n)
                return
            if r.buf[0] == "]":
                return
            if n and r.buf[0] == ",":
                r.consume(1)
                if not r.skip_ws():
                    yield _cut(path, r.base, n)
                    return
            elif n:
                yield f"{path}:record {n + 1}", b"", _invalid(path, n + 1, r.base, "expected ',' or ']'")
                return
            while True:
                try:
                    _, end = decoder.raw_decode(r.buf)
                    break
                except json.JSONDecodeError as e:
                    incomplete = e.pos >= len(r.buf) - 8 or e.msg.startswith("Unterminated string")
                    if incomplete and r.more():
                        continue
                    if incomplete:
                        yield _cut(path, r.base, n)
                    else:
                        yield f"{path}:record {n + 1}", b"", _invalid(path, n + 1, r.base + e.pos, e.msg)
                    return
            n += 1
            yield f"{path}:record {n}", r.buf[:end].encode("utf-8", _BYTES), ""
            r.consume(end)


def read_error_reason(error: str) -> str:
    """The reason a reader's error row is counted under."""
    return "truncated_file" if "(truncated_file" in error else "invalid_json"


def _cut(path: Path, offset: int, complete: int) -> tuple[str, bytes, str]:
    where = f"{path}:record {complete + 1}"
    why = (
        f"{where}: the file is cut off at byte {path.stat().st_size} inside the JSON array (truncated_file; "
        f"the incomplete record starts at byte {offset}): its {complete} complete records are read"
    )
    return where, b"", why


def _invalid(path: Path, record: int, offset: int, msg: str) -> str:
    return f"{path}:record {record}: invalid JSON at byte {offset} ({msg}); the rest of the array is not read"
