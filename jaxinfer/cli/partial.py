"""The partial-state file of ``jaxinfer generate``: in-flight work survives an interruption.

``<out>.partial.json`` (beside ``--out``) holds, for every request of the run that has not
finished, its id, a fingerprint of its record (prompt token ids + sampling params), the seed it
samples with and its output so far (token ids, and logprobs when the record asks for them). A
rerun of the same command skips the ids already in ``--out`` as before and continues each
in-flight request from its partial output (``EngineCore.add_request(resume=...)``); since sampling
keys depend only on (seed, output index), the records equal an uninterrupted run's (timing
metrics aside: ``RequestMetrics.resumed_tokens``).

- Written atomically (a temporary file, fsync, ``os.replace``, fsync of the directory) every
  ``--checkpoint-interval`` seconds while records stream in, and on SIGTERM / Ctrl-C (or any
  other stop); so a SIGKILL loses at most the last interval's tokens. Interval 0: only on a
  stop. Removed when the job completes. ``--out``'s lock covers it (one run at a time). Off in
  multi-host runs (every host would have to read the same state while process 0 rewrites it).
- The seeds of requests without one are drawn when the run starts and stored at once, so even a
  request that had not started when the run stopped keeps the seed of the first run.
- A request with ``n`` > 1 (`jaxinfer.engine.parallel_sampling`) is stored as one entry with one
state
  per completion (``"completions"``: seed, token ids, logprobs). A completion that finished
  before its siblings is kept without its last token: the rerun samples that token again (same
  seed and output index: the same token) and the completion finishes as it did.
- Trust, not faith: a file that cannot be read, is from another format version or was written
  with other model settings (`run_settings`) is ignored with a warning; an entry whose
  fingerprint does not match its record (the prompts file changed) or that the engine refuses
  (``EngineLoop.with_resume``) starts that request afresh, with a warning. Resuming is then only
  slower, never different from a from-scratch rerun.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

from jaxinfer.args import OUTPUT_SETTINGS, option_of
from jaxinfer.engine.inputs import ProcessedRequest
from jaxinfer.engine.resume import ResumeState
from jaxinfer.errors import JaxinferError
from jaxinfer.options import ChatTemplate, PathArg, is_template_text
from jaxinfer.outputs import RequestOutput, TokenLogprob
from jaxinfer.sampling.params import SamplingParams

SUFFIX = ".partial.json"
FORMAT = "jaxinfer-partial"
VERSION = 1
SETTINGS = OUTPUT_SETTINGS
"""Command-line settings a partial output depends on: the engine options that change the tokens
(``Option.changes_outputs`` in ``jaxinfer.args``); the file records them and is ignored when the
rerun's differ."""
MAX_WARNINGS = 5
"""Entries named one by one in warnings; the rest are counted."""

Warn = Callable[[str], None]


def partial_path(out: Path) -> Path:
    """The partial-state file of output file ``out``: ``<out>.partial.json``."""
    return out.with_name(out.name + SUFFIX)


def run_settings(args) -> dict:
    """The `SETTINGS` of a parsed ``generate`` command line, paths made absolute (those of path
    options that name an existing file: ``draft_model`` may be "self", ``chat_template`` the
    template text)."""
    d = {k: getattr(args, k, None) for k in SETTINGS}
    for k, v in d.items():
        if isinstance(option_of(k).check, PathArg | ChatTemplate) and v is not None:
            if not is_template_text(v) and Path(v).exists():
                d[k] = str(Path(v).resolve())
    return d


def fingerprint(prompt_ids: list[int], params: SamplingParams) -> str:
    """sha256 (hex) of a request's prompt token ids and sampling params (canonical JSON; ``n``
    left out when 1, so n = 1 fingerprints are those written before ``n`` existed; likewise
    ``prompt_logprobs`` and ``structured_outputs`` when None, and ``structured_outputs``'
    ``start_after`` and ``reasoning_start``)."""
    sampling = dataclasses.asdict(params)
    if sampling["n"] == 1:
        del sampling["n"]
    if sampling.get("prompt_logprobs") is None:  # fingerprints from before it existed
        sampling.pop("prompt_logprobs", None)
    if sampling.get("prompt_logprobs_from") == 1:
        sampling.pop("prompt_logprobs_from", None)
    for k in ("structured_outputs", "guided_decoding"):  # from before they existed
        if sampling.get(k) is None:
            sampling.pop(k, None)
    so = sampling.get("structured_outputs")
    for k in ("start_after", "reasoning_start"):  # likewise
        if so is not None and so.get(k) is None:
            so.pop(k, None)
    blob = json.dumps(
        {"prompt_token_ids": [int(t) for t in prompt_ids], "sampling": sampling},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and not (isinstance(v, float) and math.isnan(v))


def _logprob(d) -> TokenLogprob:
    """A ``TokenLogprob`` from its record form; raises ValueError."""
    if not isinstance(d, dict) or set(d) != {"token_id", "logprob", "top"}:
        raise ValueError("a logprob is not {token_id, logprob, top}")
    top = d["top"]
    if (
        not _is_int(d["token_id"])
        or not _is_num(d["logprob"])
        or not isinstance(top, list)
        or not all(
            isinstance(x, list) and len(x) == 2 and _is_int(x[0]) and _is_num(x[1]) for x in top
        )
    ):
        raise ValueError("a logprob has a field of the wrong type")
    return TokenLogprob(d["token_id"], float(d["logprob"]), [(x[0], float(x[1])) for x in top])


def _check_fields(d: dict, fields) -> None:
    for key, ok in fields:
        if key not in d or not ok(d[key]):
            raise ValueError(f"field {key!r} missing or of the wrong type")


def _state(d: dict) -> ResumeState:
    """One completion's state from its record form; raises ValueError naming the field."""
    _check_fields(
        d,
        (
            ("seed", _is_int),
            ("token_ids", lambda v: isinstance(v, list) and all(_is_int(t) for t in v)),
        ),
    )
    lps = d.get("logprobs")
    if lps is not None:
        if not isinstance(lps, list):
            raise ValueError("field 'logprobs' is not a list")
        lps = tuple(_logprob(x) for x in lps)
    return ResumeState(d["seed"], tuple(d["token_ids"]), lps)


def _entry(d) -> tuple[str, str, ResumeState | tuple[ResumeState, ...]]:
    """(id, fingerprint, state) of one stored request, the state a tuple of one per completion
    for a request with n > 1 (``"completions"``); raises ValueError naming the field."""
    if not isinstance(d, dict):
        raise ValueError("not an object")
    _check_fields(
        d, (("id", lambda v: isinstance(v, str)), ("fingerprint", lambda v: isinstance(v, str)))
    )
    if "completions" in d:
        comps = d["completions"]
        if (
            not isinstance(comps, list)
            or len(comps) < 2
            or not all(isinstance(c, dict) for c in comps)
        ):
            raise ValueError("field 'completions' is not a list of at least 2 objects")
        return d["id"], d["fingerprint"], tuple(_state(c) for c in comps)
    return d["id"], d["fingerprint"], _state(d)


def _state_fields(state: ResumeState) -> dict:
    rec = {"seed": state.seed, "token_ids": list(state.token_ids)}
    if state.logprobs is not None:
        rec["logprobs"] = [dataclasses.asdict(lp) for lp in state.logprobs]
    return rec


def _state_record(rid: str, fp: str, states: list[ResumeState]) -> dict:
    if len(states) == 1:
        return {"id": rid, "fingerprint": fp, **_state_fields(states[0])}
    return {"id": rid, "fingerprint": fp, "completions": [_state_fields(s) for s in states]}


MAX_PARTIAL_BYTES = 1 << 30
"""Largest partial file read back (a device, FIFO or larger file is ignored, never read)."""


def load(
    path: Path, settings: dict, warn: Warn
) -> dict[str, tuple[str, ResumeState | tuple[ResumeState, ...]]]:
    """The usable entries of partial file ``path``: id -> (fingerprint, state), the state a tuple
    of one per completion for a request with n > 1. A missing file is
    empty; an unreadable one, another format or version, or other `settings` are warned about
    and give nothing; a bad or repeated entry is warned about and left out."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_PARTIAL_BYTES:
            warn(
                f"partial file {path} is not a regular file of at most {MAX_PARTIAL_BYTES} "
                "bytes; ignored, in-flight work is redone"
            )
            return {}
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        warn(f"cannot read partial file {path} ({e}); in-flight work is redone")
        return {}
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        warn(f"partial file {path} is not valid JSON ({e}); ignored, in-flight work is redone")
        return {}
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        warn(
            f"partial file {path} is not a {FORMAT} file of version {VERSION}; ignored, "
            "in-flight work is redone"
        )
        return {}
    stored = doc.get("settings")
    if not isinstance(stored, dict) or stored != settings:
        diff = sorted(
            k
            for k in set(settings) | set(stored if isinstance(stored, dict) else {})
            if not isinstance(stored, dict) or stored.get(k) != settings.get(k)
        )
        warn(
            f"partial file {path} was written with other settings ({', '.join(diff)}); "
            "ignored, in-flight work is redone"
        )
        return {}
    entries, bad = {}, []
    reqs = doc.get("requests")
    for i, d in enumerate(reqs if isinstance(reqs, list) else []):
        try:
            rid, fp, state = _entry(d)
            if rid in entries:
                raise ValueError(f"id {rid!r} repeated")
        except ValueError as e:
            bad.append(f"request {i}: {e}")
            continue
        entries[rid] = (fp, state)
    if not isinstance(reqs, list):
        bad.append("'requests' is not a list")
    for msg in bad[:MAX_WARNINGS]:
        warn(f"partial file {path}: {msg}; left out")
    if len(bad) > MAX_WARNINGS:
        warn(f"partial file {path}: {len(bad) - MAX_WARNINGS} more bad entries left out")
    return entries


def write_atomic(path: Path, data: bytes) -> None:
    """Replaces ``path`` by ``data`` all at once: a reader (or a crash) sees the old file or the
    new one, never a mix. Raises OSError."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # a disk that is full gets its space back
        raise
    os.close(fd)
    os.replace(tmp, path)
    with contextlib.suppress(OSError):  # the rename's durability; not every FS lets us
        dfd = os.open(path.parent, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


class Checkpointer:
    """Keeps the run's unfinished requests' states and writes them to the partial file.

    Args:
        path: the partial file.
        settings: `run_settings` of the run.
        interval: seconds between writes while outputs stream in; 0 = only `close`.
        warn: where warnings go (stderr).
        enabled: False: nothing is read or written (multi-host runs, hosts that do not write).
    """

    def __init__(
        self, path: Path, settings: dict, interval: float, warn: Warn, enabled: bool = True
    ):
        self.path, self.settings, self.interval, self.warn = path, settings, interval, warn
        self.enabled = enabled
        self.stored = load(path, settings, warn) if enabled else {}
        # id -> (fingerprint, one state per completion)
        self.states: dict[str, tuple[str, list[ResumeState]]] = {}
        self.resumed = 0  # requests continued from a stored partial output
        self._last = time.monotonic()
        self._failed = False
        self._planned = False  # until `plan` has run, the file on disk is the one to keep

    def plan(self, llm, requests: list[ProcessedRequest]) -> list[ProcessedRequest]:
        """``requests`` (processed: encoded and validated, ``EngineLoop.process``) with the resume
        state of each completion (``EngineLoop.with_resume``, which checks the states alone): the
        stored ones when the fingerprint matches and ``llm``'s engine accepts them, else a fresh
        start with the seed drawn now (or the stored seeds of an entry whose tokens are
        refused). Writes them at once (seeds drawn now are kept, even through a SIGKILL)."""
        loop = llm.engine_loop
        flat = iter(llm.draw_seeds([csp for r in requests for csp, _ in r.children]))
        out, stale, refused = [], [], []
        for req in requests:
            rid, fp = req.request_id, fingerprint(req.prompt_ids, req.params)
            states = [ResumeState(next(flat)) for _ in req.children]
            resumed = None
            if rid in self.stored:
                sfp, stored = self.stored[rid]
                stored = [stored] if isinstance(stored, ResumeState) else list(stored)
                if sfp != fp:
                    stale.append(repr(rid))
                else:
                    try:
                        resumed = loop.with_resume(req, stored)
                        states = stored
                        self.resumed += any(st.token_ids for st in stored)
                    except JaxinferError as e:
                        refused.append(f"{rid!r} ({e})")
                        if len(stored) == req.n:
                            states = [ResumeState(st.seed) for st in stored]
            self.states[rid] = (fp, states)
            out.append(resumed or loop.with_resume(req, states))
        self._planned = True
        for what, items in (
            ("its record changed (prompt or sampling fields)", stale),
            ("the engine refused it", refused),
        ):
            for x in items[:MAX_WARNINGS]:
                self.warn(f"partial state of id {x} not used: {what}; it starts afresh")
            if len(items) > MAX_WARNINGS:
                self.warn(f"{len(items) - MAX_WARNINGS} more partial states not used: {what}")
        if self.interval > 0:
            self.flush()
        return out

    def update(self, res: RequestOutput) -> None:
        """Takes a streamed output in (after a finished one's record was written) and writes the
        file when `interval` seconds have passed since the last write."""
        entry = self.states.get(res.request_id)
        if entry is None:
            return
        if res.finished:
            del self.states[res.request_id]
        else:
            states = entry[1]
            c = res.outputs[0]  # the completion this output streams (index 0 when n = 1)
            toks, lps = c.token_ids, c.logprobs
            if c.finish_reason is not None:  # one of n finished first: resampled on resume
                toks, lps = toks[:-1], None if lps is None else lps[:-1]
            states[c.index] = ResumeState(
                states[c.index].seed, tuple(toks), None if lps is None else tuple(lps)
            )
        if self.interval > 0 and time.monotonic() - self._last >= self.interval:
            self.flush()

    def flush(self) -> None:
        """Writes the states atomically; a failure is warned about once (resume then redoes more
        work) and does not stop the run."""
        self._last = time.monotonic()
        if not self.enabled or not self._planned:
            return
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "settings": self.settings,
            "requests": [_state_record(rid, fp, st) for rid, (fp, st) in self.states.items()],
        }
        try:
            write_atomic(self.path, json.dumps(doc).encode("ascii"))
        except OSError as e:
            if not self._failed:
                self.warn(
                    f"cannot write partial file {self.path} ({e}); an interrupted run "
                    "will redo its in-flight work"
                )
            self._failed = True

    def close(self, completed: bool) -> None:
        """At the end of the run: removes the file when the job ``completed``, else writes it."""
        if not self.enabled:
            return
        if not completed:
            self.flush()
            return
        for p in (self.path, self.path.with_name(self.path.name + ".tmp")):
            try:
                p.unlink(missing_ok=True)
            except OSError as e:
                self.warn(f"cannot remove partial file {p}: {e}")
