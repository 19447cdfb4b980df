"""Trains Medusa draft heads for stories260K (or --model) and prints the JSON summary.

    python scripts/train_draft_heads.py            # stories260K, small defaults (a few minutes)
    python scripts/train_draft_heads.py --steps 1500 --num-sequences 384 --gen-tokens 96

The defaults here are small so the run finishes in a few minutes on a CPU: 256 greedy sequences
of 48 generated tokens, 300 AdamW steps of 512 positions, 8 heads. Later flags override them.
Outputs: the heads (orbax) under --out, the loss curve at --plot, held-out top-1 agreement in
the JSON summary (and the heads' metadata).
"""

import sys
from pathlib import Path

from jaxinfer.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = [
    "--model",
    str(ROOT.parent / "shared" / "models" / "stories260K"),
    "--out",
    str(ROOT / "results" / "heads_stories260K"),
    "--plot",
    str(ROOT / "results" / "heads_stories260K_loss.png"),
    "--num-heads",
    "8",
    "--num-sequences",
    "256",
    "--gen-tokens",
    "48",
    "--steps",
    "300",
    "--batch-size",
    "512",
]

if __name__ == "__main__":
    # argparse keeps the last occurrence of a flag, so the user's flags win over DEFAULTS
    sys.exit(main(["train-draft-heads", *DEFAULTS, *sys.argv[1:]]))
