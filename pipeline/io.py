"""Files between stages: JSONL reading with precise errors, atomic writes, resumable appends, manifests.

Every stage writes through these helpers so that a crash never leaves a half-written output and a rerun
resumes where the previous one stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator


class InputError(ValueError):
    """Bad input: the message names the file, the line or record id, and what was expected."""


def where(path: str | os.PathLike, line: int | None = None, record: str | None = None) -> str:
    loc = str(path)
    if line is not None:
        loc += f":{line}"
    if record is not None:
        loc += f" (record {record})"
    return loc


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise InputError(f"{where(path, e.lineno)}: invalid JSON ({e.msg}); expected one JSON document") from e


def iter_jsonl(path: str | os.PathLike, torn_tail_ok: bool = False) -> Iterator[tuple[int, dict]]:
    """Yield (line number, object) for each non-empty line; a malformed line raises InputError naming it.
    `torn_tail_ok`: a file still being written (a `.partial`) may end in a torn line, which is skipped."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                if torn_tail_ok and not raw.endswith("\n") and not f.read(1):
                    return  # the last line, cut off mid-write
                raise InputError(f"{where(path, lineno)}: invalid JSON ({e.msg}); expected one JSON object per line") from e
            if not isinstance(obj, dict):
                raise InputError(f"{where(path, lineno)}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    return [obj for _, obj in iter_jsonl(path)]


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w"):
    """Write to a temporary file beside `path` and rename it into place only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files; outputs should read like any other file
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> int:
    n = 0
    with atomic_open(path) as f:
        for row in rows:
            f.write(dumps(row) + "\n")
            n += 1
    return n


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_open(path) as f:
        json.dump(obj, f, ensure_ascii=False, indent=2)
        f.write("\n")


class ResumableJsonl:
    """Append-only JSONL output that survives interruption.

    Rows go to `<path>.partial` (one flushed line each); `done_ids()` tells a rerun what to skip; `finish()`
    renames the partial file to `path`. A torn last line (killed mid-write) is dropped on reopen, and so is a row for
    which `redo(row)` is true (e.g. a failed request, so a rerun tries it again).
    """

    def __init__(self, path: str | os.PathLike, key: str = "id", redo=None):
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.key = key
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._ids: set[str] = set()
        if self.path.exists() and not self.partial.exists():
            os.replace(self.path, self.partial)  # reopen a finished file to extend it
        if self.partial.exists():
            good = []
            with open(self.partial, encoding="utf-8") as f:
                for raw in f:
                    try:
                        obj = json.loads(raw)
                    except json.JSONDecodeError:
                        continue  # torn line from an interrupted write
                    if isinstance(obj, dict) and redo is not None and redo(obj):
                        continue
                    if isinstance(obj, dict) and obj.get(key) not in self._ids:
                        self._ids.add(obj.get(key))
                        good.append(raw if raw.endswith("\n") else raw + "\n")
            with atomic_open(self.partial) as f:
                f.writelines(good)
        self._f = open(self.partial, "a", encoding="utf-8")

    def done_ids(self) -> set[str]:
        return set(self._ids)

    def write(self, row: dict) -> None:
        if row.get(self.key) in self._ids:
            return
        self._f.write(dumps(row) + "\n")
        self._f.flush()
        self._ids.add(row.get(self.key))

    def finish(self) -> Path:
        """Close and move the rows into `path` (also after an interruption: every line written is whole, and a
        rerun reopens the file to extend it), so a stopped long job leaves a file that can be committed."""
        self._f.close()
        if self.partial.exists():
            os.replace(self.partial, self.path)
        return self.path

    def rows(self) -> dict[str, dict]:
        """The rows written so far, by key."""
        self._f.flush()
        with open(self.partial, encoding="utf-8") as f:
            return {row.get(self.key): row for row in map(json.loads, f) if isinstance(row, dict)}

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def interrupt_on_sigterm() -> None:
    """Make SIGTERM (`kill`, a session ending) raise KeyboardInterrupt, so a long stage's `finally` saves its rows."""
    import signal

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(out_dir: str | os.PathLike, stage: str, config: Any, inputs: Iterable[str | os.PathLike] = (),
                   extra: dict | None = None) -> Path:
    """Record what produced a stage's output: resolved config, input checksums, versions, time."""
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "transformers", "peft", "trl", "datasets", "jsonschema", "vllm", "deepspeed"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    inputs_sum = {}
    for p in inputs:
        p = Path(p)
        if p.is_file():
            inputs_sum[str(p)] = sha256_file(p)
    manifest = {
        "stage": stage,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config,
        "inputs": inputs_sum,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": versions,
        "argv": sys.argv,
    }
    if extra:
        manifest.update(extra)
    path = Path(out_dir) / "manifest.json"
    write_json(path, manifest)
    return path


HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def looks_like_hub_id(name: str | os.PathLike | None) -> bool:
    """`owner/name` that is not a local path: what from_pretrained would fetch from the Hub."""
    return bool(name) and HUB_REPO_ID.match(str(name)) is not None and not Path(name).exists()
