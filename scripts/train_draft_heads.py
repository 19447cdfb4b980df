"""Trains Medusa draft heads for stories260K (or --model) and prints the JSON summary.

    python scripts/train_draft_heads.py --model ../shared/models/stories260K --out results/heads_stories260K
"""

import sys

from jaxinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["train-draft-heads", *sys.argv[1:]]))
