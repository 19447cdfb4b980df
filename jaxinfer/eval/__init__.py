"""Evaluation harness integration: importing this package registers ``JaxInferLM`` with
lm-evaluation-harness as ``"jaxinfer"`` (needs the ``eval`` extra: ``pip install jaxinfer[eval]``);
``python -m jaxinfer.eval`` is the ``lm_eval`` command line with that model available.

Raises ImportError (saying which extra to install) when lm-eval is not installed."""

try:
    import lm_eval  # noqa: F401
except ImportError as e:
    raise ImportError(
        "jaxinfer.eval needs lm-evaluation-harness: pip install 'jaxinfer[eval]' "
        "(lm-eval >= 0.4.13)"
    ) from e

from jaxinfer.eval.lm_eval_model import JaxInferLM  # noqa: E402

__all__ = ["JaxInferLM"]
