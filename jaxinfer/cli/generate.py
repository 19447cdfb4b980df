"""The run of ``jaxinfer generate`` once its output file is open (``cli.cmd_generate``).

Encodes and checks each prompt once (``EngineLoop.process``), generates them with a progress
bar, writes one record per prompt as it finishes, keeps the partial-state file, prints the JSON
summary; also SIGTERM handled as Ctrl-C (``sigterm_as_interrupt``) and the exit statuses of a
run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time

from jaxinfer.cli.interrupts import EXIT_INTERRUPTED
from jaxinfer.cli.output_file import OutputFile, OutputWriteError
from jaxinfer.cli.partial import Checkpointer
from jaxinfer.cli.prompts_file import Job, plan
from jaxinfer.compile.plan import start_job
from jaxinfer.engine.inputs import ProcessedRequest, Request
from jaxinfer.errors import JaxinferError
from jaxinfer.sampling.params import SamplingParams

EXIT_WRITE_FAILED = 1


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C; the exit status is then 128 + 15 (143), not 130."""

    signum = signal.SIGTERM  # how cli.interrupts delivers it again when a callback swallowed it


def interrupt_status(e: KeyboardInterrupt) -> int:
    return 128 + signal.SIGTERM if isinstance(e, Terminated) else EXIT_INTERRUPTED


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM (a scheduler's kill) ends the run like Ctrl-C while inside: the current line is
    finished, the summary says how far it got, and a rerun resumes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        _TERMINATED.set()  # seen by the run loop if the raise lands where it is swallowed
        raise Terminated

    _TERMINATED.clear()
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_TERMINATED = threading.Event()
"""Set by the SIGTERM handler. Its ``raise`` can land inside a callback whose exceptions Python
only prints (JAX's garbage-collection callback), so the run loop also checks this flag."""


def check_terminated() -> None:
    if _TERMINATED.is_set():
        raise Terminated


def error_record(job: Job) -> dict:
    return {"id": job.id, "error": job.error, "finish_reason": "error"}


def _process(llm, job: Job) -> ProcessedRequest | None:
    """A job's request encoded and validated, once (``EngineLoop.process``); on failure sets
    ``job.error``."""
    try:
        params = SamplingParams.from_dict(job.sampling)
        return llm.engine_loop.process(Request(job.id, job.prompt, params))
    except (JaxinferError, ValueError, TypeError, KeyError) as e:
        job.error = f"line {job.line}: {e}"
        return None


def _generate(
    llm,
    run: list[ProcessedRequest],
    out: OutputFile,
    stats: dict,
    bar,
    ckpt: Checkpointer,
) -> None:
    """Generates ``run`` (the jobs' requests, processed), continuing the requests ``ckpt`` holds
    partial outputs of; writes each record (and counts it in ``stats``) as its prompt finishes,
    and gives ``ckpt`` every output. Raises OutputWriteError."""
    run = ckpt.plan(llm, run)  # with their resume states (checked alone, not the requests)
    resume = [[st for _, st in r.children] for r in run]
    resume = [states[0] if len(states) == 1 else states for states in resume]
    ids, params = [r.prompt_ids for r in run], [r.params for r in run]
    start_job(llm, ids, params, resume, bar, background=True)  # k/n
    stats["resumed"] = ckpt.resumed
    for res in llm.engine_loop.stream(run):  # processed: not validated again
        check_terminated()
        if bar is not None:
            bar.add_output(res)  # tokens so far and tok/s on the line, not only finished prompts
        if not res.finished:
            ckpt.update(res)
            continue
        out.write(res.to_record())
        ckpt.update(res)  # after the record: a crash between the two leaves the id done
        stats["resumed_tokens"] += res.metrics.resumed_tokens
        if res.error is not None:
            stats["errors"] += 1
        else:
            stats["completed"] += 1
            stats["prompt_tokens"] += res.metrics.prompt_tokens
            stats["completion_tokens"] += res.metrics.completion_tokens
        if bar is not None:
            bar.update(1)


def run_jobs(
    args: argparse.Namespace,
    jobs: list[Job],
    out: OutputFile,
    say,
    t_start: float,
    ckpt: Checkpointer,
    load_llm,
) -> int:
    """The run of ``cli.cmd_generate`` once ``out`` is open: resume, load (``load_llm(args)``,
    only when some prompt is left to run), generate, summary; returns the exit status."""
    quiet = args.quiet
    out_path = out.path
    done = out.read_done(say)
    if done.truncated:
        say(f"{out_path}: cut away a partial last line (interrupted write)")
    run, errors, skipped = plan(jobs, done.ids)

    llm = load_llm(args) if run else None
    requests = []
    for job in run:
        request = _process(llm, job)
        if request is None:
            errors.append(job)
        else:
            requests.append(request)
    if skipped:
        say(f"{skipped} prompt(s) already in {out_path}; skipping them")

    stats = {
        "prompts": len(jobs),
        "completed": 0,
        "errors": 0,
        "skipped": skipped,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "resumed": 0,  # requests continued from the partial file
        "resumed_tokens": 0,  # their output tokens carried over (not computed by this run)
    }
    bar = None
    if requests and not (args.no_progress or quiet):
        from tqdm import tqdm

        from jaxinfer.compile.progress import CompileProgressBar

        bar = CompileProgressBar(
            tqdm(  # "compiling (k)" on the line while a step compiles
                total=len(requests),
                desc="prompts",
                unit="prompt",
                file=sys.stderr,
                dynamic_ncols=True,
            ),
            llm,
        )
    interrupted = 0  # the exit status of an interruption (130 Ctrl-C, 143 SIGTERM), else 0
    write_error = None  # why the output file could not be written
    t_gen = time.perf_counter()
    completed = False
    try:
        for job in errors:
            out.write(error_record(job))
            stats["errors"] += 1
        if requests:
            _generate(llm, requests, out, stats, bar, ckpt)
        completed = True
    except KeyboardInterrupt as e:
        interrupted = interrupt_status(e)
    except OutputWriteError as e:  # disk full, I/O error: stop, but still report the run
        write_error = str(e)
    finally:
        if bar is not None:
            bar.close()
        ckpt.close(completed)  # in-flight tokens kept for the rerun, or the file removed
    gen_s = time.perf_counter() - t_gen
    summary = {
        **stats,
        "wall_s": round(time.perf_counter() - t_start, 3),
        "generate_s": round(gen_s, 3),
        "throughput_tok_s": round(stats["completion_tokens"] / gen_s, 2) if gen_s > 0 else 0.0,
        "compilations": llm.num_compilations if llm is not None else 0,
        "preemptions": llm.engine.scheduler.num_preemptions if llm is not None else 0,
        # the attention implementation that ran ("auto" resolved per engine: cpu_kernel or xla)
        "attn_impl": llm.engine.ecfg.attn_impl if llm is not None else None,
        **_prefix_cache_summary(llm),
        "interrupted": bool(interrupted),
        "out": str(out_path),
    }
    if write_error is not None:
        summary["error"] = write_error
        n = stats["completed"] + stats["errors"]
        print(
            f"jaxinfer: error: {write_error}; stopped after {n} record(s) in this run. "
            "Free space (or fix the file) and rerun the same command to resume.",
            file=sys.stderr,
            flush=True,
        )
    elif interrupted:
        n = stats["completed"] + stats["errors"]
        print(
            f"jaxinfer: interrupted; {n} record(s) written to {out_path} in this run "
            f"({n + skipped} of {len(jobs)} in all). Rerun the same command to resume"
            + (f" (requests in flight continue from {ckpt.path})." if ckpt.enabled else "."),
            file=sys.stderr,
            flush=True,
        )
    else:
        say(
            f"{stats['completed']} completed, {stats['errors']} error(s), {skipped} skipped; "
            f"{stats['prompt_tokens']} tokens in, {stats['completion_tokens']} out; "
            f"{summary['wall_s']:.1f} s wall, {summary['throughput_tok_s']:.1f} output tok/s; "
            f"{summary['compilations']} compilation(s), {summary['preemptions']} preemption(s); "
            f"prefix cache hit rate {summary['prefix_cache_hit_rate']:.1%}, "
            f"{summary['prefix_cache_evictions']} eviction(s)"
        )
    print(json.dumps(summary), flush=True)
    return EXIT_WRITE_FAILED if write_error is not None else interrupted or 0


def _prefix_cache_summary(llm) -> dict:
    """The summary's prefix-cache fields: hit rate (cached prompt tokens / prompt tokens looked
    up, recomputation included), cached tokens, evictions."""
    st = llm.prefix_cache_stats() if llm is not None else {}
    return {
        "prefix_cache_hit_rate": round(st.get("hit_rate", 0.0), 4),
        "prefix_cached_tokens": st.get("hit_tokens", 0),
        "prefix_cache_evictions": st.get("evictions", 0),
    }
