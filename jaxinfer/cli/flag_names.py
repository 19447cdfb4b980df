"""Engine-setting messages in the command line's words: ``LLM`` argument names become flags.

``LLM`` and ``EngineConfig`` raise ``ValueError`` naming their Python arguments
(``max_model_len=0 is out of range``); ``jaxinfer generate`` and ``serve`` show those messages
with the flag the user typed instead (``--max-model-len 0 is out of range``).
"""

from __future__ import annotations

import re

# The LLM arguments the command line sets through a flag of the same name (``llm_from_args``);
# --no-prefix-caching and --no-reuse-compiled-buckets invert theirs and are left as they are.
FLAG_ARGS = (
    "dtype",
    "max_model_len",
    "kv_pages",
    "page_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "attn_impl",
    "quantization",
    "kv_cache_dtype",
    "async_scheduling",
    "batch_invariant",
    "tokenizer",
    "skip_tokenizer_init",
    "seed",
    "tensor_parallel_size",
    "data_parallel_size",
    "speculative",
    "num_speculative_tokens",
    "draft_model",
    "draft_heads",
)

_NAMES = "|".join(sorted(FLAG_ARGS, key=len, reverse=True))
# name=value, value a Python repr as the messages write it: 'text', a number, True, False, None.
_ASSIGNED = re.compile(rf"(?<![\w.\-/])({_NAMES})=('[^']*'|-?[\w.+]+)")
# A bare name: only the ones with an underscore (words like "tokenizer" or "seed" are prose too),
# not inside a path or a quoted value.
_UNDERSCORED = "|".join(n for n in FLAG_ARGS if "_" in n)
_BARE = re.compile(rf"(?<![\w.\-/'\"])({_UNDERSCORED})(?![\w\-/'\"=])")


def flag(name: str) -> str:
    """The command-line flag of an ``LLM`` argument: ``max_model_len`` -> ``--max-model-len``."""
    return "--" + name.replace("_", "-")


def _assigned(m: re.Match) -> str:
    name, value = m.group(1), m.group(2)
    if value == "True":
        return flag(name)
    if value in ("False", "None"):
        return m.group(0)  # no flag spells these
    return f"{flag(name)} {value.strip(chr(39))}"


def as_flags(message: str) -> str:
    """``message`` with each ``FLAG_ARGS`` argument written as its flag: ``name=value`` as
    ``--name value`` (``--name`` for True; False and None left as they are), a bare name with an
    underscore as ``--name``."""
    return _BARE.sub(lambda m: flag(m.group(1)), _ASSIGNED.sub(_assigned, message))
