"""`metrics.jsonl`: one JSON object per monitor tick and per eval, flushed line by line."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TextIO

from dflash.core.jsonio import json_safe
from dflash.core.rundir import METRICS_FILE
from dflash.tracking.base import Callback, RunInfo


class JsonlCallback(Callback):
    """Appends one JSON object per metrics tick and per eval to `run_dir/metrics.jsonl`.

    Append mode, so a resumed run continues the same file; each line is flushed as it is written, so a
    crashed run keeps every tick up to the crash. Eval lines carry `step` and the `eval/*` keys only, which is
    how readers tell them apart from training ticks. Non-finite floats are written as null (`json_safe`).
    """

    FILENAME = METRICS_FILE

    def __init__(self, run_dir: Path | str) -> None:
        self.path = Path(run_dir) / self.FILENAME
        self._file: TextIO | None = None
        self._lock = threading.Lock()  # the monitor thread and the eval caller may both write

    def on_run_start(self, info: RunInfo) -> None:
        self._open()

    def on_metrics(self, metrics: dict) -> None:
        self._write(metrics)

    def on_eval(self, results: dict) -> None:
        self._write(results)

    def on_run_end(self, status: str, summary: dict) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _open(self) -> TextIO:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        return self._file

    def _write(self, record: dict) -> None:
        line = json.dumps(json_safe(record), allow_nan=False, separators=(",", ":"))
        with self._lock:
            f = self._open()
            f.write(line + "\n")
            f.flush()
