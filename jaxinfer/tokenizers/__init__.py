"""Tokenizers: load, encode, decode, chat templates and streaming detokenization (host side).

Three backends behind one interface (``Tokenizer``):

- ``tokenizer.json`` through Hugging Face ``tokenizers`` (``hf.py``);
- SentencePiece ``*.model`` through ``sentencepiece`` (``sentencepiece_model.py``);
- llama2.c ``tokenizer.bin`` through our own reader and the BPE of llama2.c's ``run.c``
  (``llama2c.py``; no library reads that format).

Chat templates are rendered as transformers' ``apply_chat_template`` renders them, within
time, size and depth limits (``chat_template.py``, ``template_limits.py``).
Everything here is plain Python on the host. The public names are re-exported by
``jaxinfer.tokenizers``.
"""

from jaxinfer.tokenizers.base import Tokenizer
from jaxinfer.tokenizers.detokenizer import IncrementalDetokenizer
from jaxinfer.tokenizers.hf import HFTokenizer
from jaxinfer.tokenizers.llama2c import Llama2cTokenizer
from jaxinfer.tokenizers.loader import load_tokenizer
from jaxinfer.tokenizers.sentencepiece_model import SentencePieceTokenizer

__all__ = [
    "HFTokenizer",
    "IncrementalDetokenizer",
    "Llama2cTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "load_tokenizer",
]
