"""Parity figures of jaxinfer against Hugging Face transformers, per family, as JSON.

Builds the tiny random checkpoints of ``tests/hf_fixtures.py`` in a temporary directory and prints,
for each: f32 and bf16 max abs / max rel / RMS rel error of jaxinfer's logits against transformers'
(metric: max|jax - hf| and that divided by max|hf_f32|), plus transformers' own bf16 error against
its f32 logits, the yardstick of the bf16 bound in ``tests/test_hf_parity.py``.

Usage: python scripts/parity_report.py [family ...]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import hf_fixtures as H  # noqa: E402


def main(names: list[str]) -> None:
    report = {}
    with tempfile.TemporaryDirectory() as root:
        for name in names or list(H.CASES):
            path = H.build_checkpoint(name, os.path.join(root, name))
            report[name] = H.parity_figures(path)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
