"""The tokenizer interface of the engine; the implementation lives in ``jaxinfer.tokenizers``.

``load_tokenizer(path, vocab_size=None) -> Tokenizer`` loads a checkpoint's tokenizer
(``tokenizer.json``, SentencePiece ``*.model`` or llama2.c ``tokenizer.bin``);
``IncrementalDetokenizer`` streams generated ids as text.
"""

from jaxinfer.tokenizers import (
    HFTokenizer,
    IncrementalDetokenizer,
    Llama2cTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
)

__all__ = [
    "HFTokenizer",
    "IncrementalDetokenizer",
    "Llama2cTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "load_tokenizer",
]
