"""The output JSONL file of ``jaxinfer generate``: one writer at a time, resume, whole lines.

- ``--out`` must be a regular file (or not exist yet). A character device (``/dev/full``,
  ``/dev/null``), FIFO, socket or directory is refused before anything is read from it: the
  file is read back to resume, so it has to be one.
- It is opened for appending and locked (``flock``, exclusive, non-blocking) before the model
  loads: a second run given the same file is refused at once (exit 2) instead of writing every
  id twice, and an unwritable file or directory is reported before any loading time is spent.
  The lock goes with the open file, so a killed run leaves no stale lock behind.
- An output file this run created is removed again if the run stops before writing anything
  (a usage error while loading the model), so a failed command leaves nothing behind.
- Each record is one ``write`` of one whole line; a partial last line (a crash in the middle of
  a write) is cut away by the next run before it appends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

from jaxinfer.cli.prompts_file import UsageError

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)
MAX_WARNINGS = 5
"""Unreadable lines of an existing output file named one by one; the rest are counted."""


class OutputWriteError(Exception):
    """Writing a record to the output file failed (disk full, I/O error, file too large)."""


@dataclasses.dataclass
class Done:
    """Ids found in an existing output file."""

    ids: set[str] = dataclasses.field(default_factory=set)  # results and error records
    truncated: bool = False  # a partial last line was cut away


def _kind(mode: int) -> str | None:
    """What a non-regular file is, or None for a regular file."""
    return (
        None
        if stat.S_ISREG(mode)
        else next((name for test, name in _KINDS if test(mode)), "not a regular file")
    )


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class OutputFile:
    """``--out``, open and locked; see the module docstring. Use `open`, then `read_done`,
    `write` for each record and `close`."""

    def __init__(self, path: Path, fd: int, created: bool, sink: bool = False):
        self.path, self.fd, self.created, self.sink = path, fd, created, sink
        self.written = 0  # records written by this run

    @classmethod
    def reader(cls, path: Path) -> OutputFile:
        """For a host that computes but does not write (multi-host, process > 0): ``read_done``
        reads ``path`` (shared with the writing host) without locking or cutting it, if it is a
        regular file, and `write` only counts."""
        fd = -1
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            if _kind(os.fstat(fd).st_mode) is not None:
                os.close(fd)
                fd = -1
        return cls(path, fd, False, sink=True)

    @classmethod
    def open(cls, path: Path, prompts: Path | None = None) -> OutputFile:
        """Opens ``path`` for appending (creating it) and takes its lock.

        Raises:
            UsageError: ``path`` is not a regular file, is ``prompts`` itself, cannot be opened
                for writing (its directory or itself unwritable), or another run holds its lock.
        """
        try:
            kind = _kind(os.stat(path).st_mode)
        except FileNotFoundError:
            kind = None
        except OSError as e:
            raise UsageError(f"cannot use --out {path}: {e}") from None
        if kind is not None:
            raise UsageError(
                f"--out {path} is {kind}, not a regular file; results are appended "
                "to a regular file and read back to resume a run"
            )
        if not path.parent.is_dir():
            raise UsageError(f"directory of --out {path} does not exist")
        flags = os.O_RDWR | os.O_APPEND | os.O_CLOEXEC | os.O_NONBLOCK  # no wait on a FIFO
        for _ in range(10):  # a file replaced between open and lock is opened again
            try:
                try:
                    fd, created = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666), True
                except FileExistsError:
                    try:
                        fd, created = os.open(path, flags), False
                    except FileNotFoundError:  # removed between the two opens
                        continue
            except OSError as e:  # not creatable there (/proc, a read-only directory, ...)
                raise UsageError(f"cannot open --out {path} for writing: {e}") from None
            try:
                st = os.fstat(fd)
                kind = _kind(st.st_mode)
                if kind is not None:
                    raise UsageError(f"--out {path} is {kind}, not a regular file")
                if prompts is not None and os.path.samestat(st, os.stat(prompts)):
                    raise UsageError(f"--out {path} is the prompts file itself")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise UsageError(
                        f"--out {path} is being written by another jaxinfer run (it holds the "
                        "file's lock); wait for that run to end, or give another --out"
                    ) from None
                except OSError as e:
                    raise UsageError(f"cannot lock --out {path}: {e}") from None
                try:
                    same = os.path.samestat(st, os.stat(path))
                except FileNotFoundError:
                    same = False
            except BaseException:
                os.close(fd)
                raise
            if same:
                return cls(path, fd, created)
            os.close(fd)  # the path now names another file: lock that one instead
        raise UsageError(f"--out {path} keeps being replaced by another process")

    def read_done(self, warn: Callable[[str], None], *, cut_partial: bool = True) -> Done:
        """The ids of the records already in the file; cuts away a partial last line (a crash
        in the middle of a write) unless ``cut_partial`` is False, then it is only ignored.

        Raises:
            UsageError: the file cannot be read or cut.
        """
        done = Done()
        if self.fd < 0:
            return done
        bad = []
        start = 0  # byte offset of the current line
        try:
            with open(os.dup(self.fd), "rb") as f:
                f.seek(0)
                for n, (raw, size, whole) in enumerate(_bounded_lines(f, MAX_RECORD_BYTES), 1):
                    if not whole:  # a partial last line
                        if cut_partial and not self.sink:
                            os.ftruncate(self.fd, start)
                            done.truncated = True
                        break
                    start += size
                    if raw is None:  # longer than any record: skipped unread
                        bad.append(n)
                        continue
                    try:
                        rid = json.loads(raw)["id"]
                    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
                        if raw.strip():
                            bad.append(n)
                        continue
                    done.ids.add(str(rid))
        except OSError as e:
            raise UsageError(f"cannot read output file {self.path}: {e}") from None
        for n in bad[:MAX_WARNINGS]:
            warn(f"{self.path} line {n} is not a record with an id; left as is")
        if len(bad) > MAX_WARNINGS:
            warn(f"{self.path}: {len(bad) - MAX_WARNINGS} more lines are not records with an id")
        return done

    def write(self, record: dict) -> None:
        """Appends ``record`` as one JSON line in one write, so a line is whole or absent.

        Raises:
            OutputWriteError: the write failed (the message names the file and the OS error).
        """
        if self.sink:
            self.written += 1
            return
        text = json.dumps(record, ensure_ascii=False) + "\n"
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: the same JSON value with \u escapes
            data = (json.dumps(record) + "\n").encode("ascii")
        try:
            _write_all(self.fd, data)
        except OSError as e:
            raise OutputWriteError(f"cannot write output file {self.path}: {e}") from None
        self.written += 1

    def close(self, *, discard: bool = False) -> None:
        """Releases the lock. With ``discard``, a file this run created and left empty is
        removed first (the run failed before writing anything)."""
        if self.fd < 0:
            return
        try:
            if discard and self.created and os.fstat(self.fd).st_size == 0:
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)
            self.fd = -1


MAX_RECORD_BYTES = 64 * 2**20
"""Longest output line read back on resume; a longer one is read through unkept (not a record)."""


def _bounded_lines(f, limit: int):
    """(line or None, bytes, whole) for each line of binary file ``f``: ``whole`` is False for a
    partial last line (no newline); a line longer than ``limit`` is read through in chunks and
    given as None, never held in memory."""
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield raw, len(raw), raw.endswith(b"\n")
            continue
        size = len(raw)
        while True:
            chunk = f.readline(1 << 20)
            size += len(chunk)
            if not chunk or chunk.endswith(b"\n"):
                break
        yield None, size, bool(chunk)
        if not chunk:
            return
