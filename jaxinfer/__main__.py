"""``python -m jaxinfer`` and the ``jaxinfer`` command: ``jaxinfer.cli.main`` with Ctrl-C
handled from the first import on: one line and exit status 130, no traceback.

While jax and the command's modules import, a first Ctrl-C is held until the imports end (a
``KeyboardInterrupt`` raised inside jax's native start-up code aborted the process with a
C++ ``terminate``); a second one interrupts at once. From then on ``jaxinfer.cli.main`` handles
it, with ``jaxinfer.cli.interrupts`` bringing back one lost in jax's gc callback.
"""

import os
import signal
import sys


def run() -> int:
    """Runs the command line (``jaxinfer.cli.main.main``); returns its exit status."""
    held = _HeldInterrupts()
    try:
        with held:  # before any other import
            from jaxinfer.cli.interrupts import EXIT_INTERRUPTED, interrupts_not_swallowed
            from jaxinfer.cli.main import main
        if held:
            raise KeyboardInterrupt
        with interrupts_not_swallowed():
            status = main()
    except KeyboardInterrupt:  # while importing; main() handles its own
        print("jaxinfer: interrupted", file=sys.stderr, flush=True)
        return 130  # jaxinfer.cli.interrupts.EXIT_INTERRUPTED, which may not be imported yet
    if status in (EXIT_INTERRUPTED, 128 + signal.SIGTERM):
        # Interrupted (its files closed, its message printed): leave without the interpreter's
        # teardown, which could crash (SIGSEGV) under a compile that was still running.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


class _HeldInterrupts:
    """Inside, a first SIGINT is only counted (``bool(self)`` says whether one came); a second
    raises KeyboardInterrupt. The previous handler is restored on leaving."""

    def __init__(self):
        self.count = 0

    def __bool__(self) -> bool:
        return self.count > 0

    def _handler(self, signum, frame) -> None:
        self.count += 1
        if self.count > 1:
            raise KeyboardInterrupt

    def __enter__(self):
        self.previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self.previous)


if __name__ == "__main__":
    sys.exit(run())
