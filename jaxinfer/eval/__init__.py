"""Evaluation harness integration: importing this package registers ``JaxInferLM`` with
lm-evaluation-harness as ``"jaxinfer"`` (needs the ``eval`` extra: ``pip install jaxinfer[eval]``);
``python -m jaxinfer.eval`` is the ``lm_eval`` command line with that model available."""

from jaxinfer.eval.lm_eval_model import JaxInferLM

__all__ = ["JaxInferLM"]
