"""Issue 15, class 5: the output file of ``jaxinfer generate`` (`jaxinfer.cli.output_file`): one
locked writer, regular files only (never read a device or FIFO), an unwritable path refused
before the model loads, a failed write still prints the summary, resume reads any existing file
(an overlong line is skipped, never held, and a partial last line is cut). No model
is loaded (a fixture fails the test if one would be); the cross-process lock is also checked in
test_cli.py's kill test.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest

from jaxinfer.cli import main as cli
from jaxinfer.cli import output_file as outfile
from jaxinfer.cli.output_file import OutputFile, OutputWriteError

GOOD = json.dumps({"id": "ok", "prompt": "Once upon a time"}).encode()


def _main(tmp_path, prompts: Path, out: Path | str, *flags: str) -> int:
    return cli.main(
        [
            "generate",
            "--model",
            str(tmp_path),  # exists; never loaded (see no_model)
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--no-progress",
            *flags,
        ]
    )


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if the model would be loaded."""

    def load(args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "_load_llm", load)


def _one_line_err(capsys) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxinfer: error: "), err
    assert captured.out == ""  # no summary: nothing was run
    return err[0]


def test_second_writer_is_refused(tmp_path, capsys, no_model):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(GOOD + b"\n")
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": "old"}\n{"id": "partial')
    holder = OutputFile.open(out)  # another run writing this file (its own open file)
    try:
        assert _main(tmp_path, prompts, out) == 2
        assert "being written by another jaxinfer run" in _one_line_err(capsys)
        assert out.read_bytes() == b'{"id": "old"}\n{"id": "partial'  # not even cut
    finally:
        holder.close()
    # A killed holder's lock goes with its file: the next run gets the lock.
    again = OutputFile.open(out)
    assert again.read_done(lambda m: None).ids == {"old"}
    again.close()


def test_output_that_is_not_a_regular_file_is_refused_unread(tmp_path, capsys, no_model):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(GOOD + b"\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # a read would block forever
    for path, kind in [
        ("/dev/full", "character device"),
        ("/dev/zero", "character device"),
        (fifo, "FIFO"),
        (tmp_path, "directory"),
        (prompts, "prompts file"),
    ]:
        assert _main(tmp_path, prompts, path) == 2, path
        assert kind in _one_line_err(capsys), path
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_output_is_refused_before_the_model_loads(tmp_path, capsys, no_model):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(GOOD + b"\n")
    ro_dir = tmp_path / "ro"
    ro_dir.mkdir(mode=0o555)
    ro_file = tmp_path / "ro.jsonl"
    ro_file.write_bytes(b"")
    ro_file.chmod(0o444)
    for out in [ro_dir / "out.jsonl", ro_file]:
        assert _main(tmp_path, prompts, out) == 2
        assert "Permission denied" in _one_line_err(capsys)


def test_open_failure_is_refused_before_the_model_loads(tmp_path, capsys, no_model, monkeypatch):
    # As the test above, for any user (root included): the OS refuses to open the file.
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(GOOD + b"\n")
    real_open = os.open

    def open_(path, flags, *a):
        if str(path).endswith("out.jsonl") and flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(outfile.os, "open", open_)
    assert _main(tmp_path, prompts, tmp_path / "out.jsonl") == 2
    assert "cannot open --out" in _one_line_err(capsys)
    assert not (tmp_path / "out.jsonl").exists()


def test_empty_or_missing_output_path_is_one_line_before_the_model_loads(
    tmp_path, capsys, no_model, monkeypatch
):
    """A new user's slips (issue 29): ``--out ""`` (once read as the current directory), a
    missing directory, a path under a file, a directory where files cannot be created (/proc:
    ENOENT on create, once retried as "keeps being replaced"): one line, exit 2, no file."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(GOOD + b"\n")
    for out, want in [
        ("", "--out is empty: give the path of a file"),
        ("/nonexistent_dir/x.jsonl", "directory of --out /nonexistent_dir/x.jsonl does not exist"),
        (prompts / "x.jsonl", "Not a directory"),
    ]:
        assert _main(tmp_path, prompts, out) == 2, out
        assert want in _one_line_err(capsys), out
    assert _main(tmp_path, "", tmp_path / "o.jsonl") == 2
    assert "--prompts is empty: give the path of a file" in _one_line_err(capsys)
    real_open = os.open

    def open_(path, flags, *a):  # as /proc/x.jsonl: no file can be created there
        if str(path).endswith("out.jsonl") and flags & os.O_CREAT:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(outfile.os, "open", open_)
    assert _main(tmp_path, prompts, tmp_path / "out.jsonl") == 2
    assert "cannot open --out" in _one_line_err(capsys)
    assert sorted(os.listdir(tmp_path)) == ["p.jsonl"]


def test_write_failure_still_prints_the_summary(tmp_path, capsys, no_model, monkeypatch):
    # Only bad records, so no model is needed; the second write finds the disk full.
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b"bad 1\nbad 2\nbad 3\n")
    calls = []
    real = outfile._write_all

    def write_all(fd, data):
        calls.append(data)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    monkeypatch.setattr(outfile, "_write_all", write_all)
    out = tmp_path / "out.jsonl"
    assert _main(tmp_path, prompts, out) == 1
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert "No space left on device" in summary["error"] and str(out) in summary["error"]
    assert summary["errors"] == 1 and summary["prompts"] == 3
    assert "No space left on device" in captured.err and "rerun" in captured.err
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["line-1"]


def test_write_to_a_full_device_raises_output_write_error(tmp_path):
    # The real ENOSPC of /dev/full, behind an OutputFile (open refuses the path itself).
    f = OutputFile(Path("/dev/full"), os.open("/dev/full", os.O_WRONLY), created=False)
    with pytest.raises(OutputWriteError, match="No space left on device"):
        f.write({"id": "x"})
    f.close()


def test_resume_reads_any_output_file_without_failing(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(
        b'{"id": "a"}\n' + b"[" * 100_000 + b'\n[1]\n\xff\xfe\n"s"\n{"id": 3}\n' + b'{"id": "cut'
    )
    warnings = []
    f = OutputFile.open(out)
    done = f.read_done(warnings.append)
    f.close()
    assert done.ids == {"a", "3"} and done.truncated
    assert len(warnings) == 4 and all("not a record with an id" in w for w in warnings)
    assert out.read_bytes().endswith(b'{"id": 3}\n')


def test_resume_never_holds_an_overlong_output_line(tmp_path, monkeypatch):
    import jaxinfer.cli.output_file as outfile

    monkeypatch.setattr(outfile, "MAX_RECORD_BYTES", 64)
    out = tmp_path / "o.jsonl"
    out.write_bytes(
        b'{"id": "a"}\n'
        + b'{"id": "'
        + b"x" * 500
        + b'"}\n'
        + b'{"id": "b"}\n'
        + b'{"id": "c", "te'
    )
    warnings = []
    f = outfile.OutputFile.open(out)
    done = f.read_done(warnings.append)
    assert done.ids == {"a", "b"} and done.truncated
    assert any("line 2" in w for w in warnings)
    assert out.read_bytes().endswith(b'{"id": "b"}\n')  # the partial last line is cut
