"""``python -m jaxinfer.eval ARGS``: lm-evaluation-harness's ``lm_eval ARGS`` with the ``jaxinfer``
model registered (lm-eval 0.4.13 finds models only in its own table or in modules imported
before its command line runs), e.g.::

    python -m jaxinfer.eval --model jaxinfer \\
        --model_args pretrained=../shared/models/stories260K,max_model_len=512 \\
        --include_path examples/lm_eval --tasks stories_mc

(``examples/lm_eval``: an offline task shipped with the repository; ``max_model_len`` at most the
model's context, 512 tokens for stories260K.)
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """Runs lm-eval's command line on ``argv`` (default ``sys.argv[1:]``)."""
    from lm_eval.__main__ import cli_evaluate

    import jaxinfer.eval  # noqa: F401  (registers "jaxinfer")

    if argv is not None:
        sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
