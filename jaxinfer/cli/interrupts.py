"""Ctrl-C ends a command quietly at any phase, imports and model loading included.

JAX runs ``_xla_gc_callback`` at every garbage collection; a Ctrl-C whose ``KeyboardInterrupt``
is raised inside it (or inside any other callback whose exceptions Python only reports through
``sys.unraisablehook``) was printed as "Exception ignored in ..." with a traceback, and lost:
the command went on as if nothing had been pressed. ``interrupts_not_swallowed`` hands such an
interrupt back to the main thread, where the command's own handler ends it (one line, exit
status 130). This module imports nothing heavy: ``jaxinfer.__main__`` uses it before jax loads.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended
REDELIVER_AFTER_S = 0.05


@contextlib.contextmanager
def interrupts_not_swallowed() -> Iterator[None]:
    """While inside, a ``KeyboardInterrupt`` that a callback swallowed is delivered again to the
    main thread ``REDELIVER_AFTER_S`` later (the signal of ``exc_type.signum``, default SIGINT:
    a ``Terminated`` comes back as SIGTERM, to its handler), without its traceback; other
    unraisable exceptions go to the previous hook."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        exc_type = unraisable.exc_type
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            # From another thread, a moment later: a signal tripped here would raise inside
            # this hook, where Python swallows it again.
            signum = getattr(exc_type, "signum", signal.SIGINT)
            timer = threading.Timer(REDELIVER_AFTER_S, _thread.interrupt_main, args=(signum,))
            timer.daemon = True
            timer.start()
            return
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous
