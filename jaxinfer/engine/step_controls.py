"""Host-side logits controls of a step (penalties, ``min_tokens`` bans), numpy only.

``EngineCore`` builds them for the rows that need them; a step without such rows passes none, and
its sampling compiles without them.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.engine.sequence import Sequence
from jaxinfer.engine.step import LogitsControls
from jaxinfer.sampling.sampler import SamplingParams


def has_penalties(p: SamplingParams) -> bool:
    """Whether ``p`` asks for a repetition, presence or frequency penalty."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def needs_controls(seq: Sequence) -> bool:
    """Whether ``seq``'s next token needs logits controls: penalties, or stop ids banned while
    it has fewer than ``min_tokens`` outputs (pending ones counted)."""
    p = seq.params
    return len(seq.output_ids) + len(seq.pending) < p.min_tokens or has_penalties(p)


def logits_controls(rows, b: int, vocab_size: int, stop_ids) -> LogitsControls | None:
    """The controls of a step's rows ((ScheduledRow, row index) pairs) padded to ``b`` rows, or
    None when no row needs them: prompt mask bool[B', V] (prompt tokens), output counts
    i32[B', V] (collected outputs only: rows with penalties wait for their pending tokens), and
    banned bool[B', V] (stop ids, and ``stop_ids`` unless ``ignore_eos``, while the row has
    fewer than ``min_tokens`` outputs)."""
    if not any(needs_controls(r.seq) for r, _ in rows):
        return None
    v = vocab_size
    prompt_mask = np.zeros((b, v), bool)
    counts = np.zeros((b, v), np.int32)
    banned = np.zeros((b, v), bool)
    for row, r in rows:
        seq = row.seq
        prompt_mask[r, seq.prompt_ids] = True
        np.add.at(counts[r], np.asarray(seq.output_ids, np.int64), 1)  # no pending: see above
        if len(seq.output_ids) + len(seq.pending) < seq.params.min_tokens:
            stops = list(seq.params.stop_token_ids)
            if not seq.params.ignore_eos:
                stops += list(stop_ids)
            banned[r, [t for t in stops if 0 <= t < v]] = True
    return LogitsControls(prompt_mask, counts, banned)
