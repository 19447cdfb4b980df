"""Model directories that ``bench_serve.py`` serves: the Hugging Face directory for
`transformers serve` (stories260K's SentencePiece tokenizer beside the weights), and a random
Llama's directory with that tokenizer extended to the model's vocabulary (for both servers)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from benchlib import STORIES, resolve_model


def hf_serve_dir(model: str) -> Path:
    """The Hugging Face directory of ``model`` with stories260K's SentencePiece tokenizer and a
    LlamaTokenizer config (as tests/test_lm_eval.py), for `transformers serve`: the weight
    files are links to the converted (stories260K) or random (llama110m) checkpoint."""
    _, _, src = resolve_model(model, hf=True)
    if src is None:
        raise FileNotFoundError(f"{model} is not a Hugging Face directory (no config.json)")
    return _linked_dir(
        src,
        src.with_name(src.name + "-hf-serve3"),
        lambda dst: shutil.copy(STORIES / "tok512.model", dst),
    )


def _linked_dir(src: Path, path: Path, write_tokenizer) -> Path:
    """``path`` (made once, atomically): ``src``'s files linked, ``write_tokenizer(dst)`` writing
    its tokenizer.model and a LlamaTokenizer config beside them."""
    if not (path / "tokenizer_config.json").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True)
        for f in src.iterdir():
            if f.is_file() and f.name not in ("tokenizer.model", "tokenizer_config.json"):
                (tmp / f.name).symlink_to(f.resolve())
        write_tokenizer(tmp / "tokenizer.model")
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "LlamaTokenizer",
                    "bos_token": "<s>",
                    "eos_token": "</s>",
                    "unk_token": "<unk>",
                    "add_bos_token": True,
                }
            )
        )
        tmp.rename(path)
    return path


def full_vocab_tokenizer(src: Path, vocab: int, dst: Path) -> None:
    """Writes ``src`` (a SentencePiece model) to ``dst`` with pieces added up to ``vocab``:
    piece ``i`` is the text ``<i>`` in mathematical angle brackets (U+27E8/9), scored below
    every piece of ``src``. The added pieces never occur in text the original pieces make (so
    prompts tokenize as before) and each decodes to non-empty text, so a random model's ids past
    the original pieces stream text in every server, one piece each. Raises ValueError when
    ``vocab`` is smaller than the model."""
    from sentencepiece import sentencepiece_model_pb2 as spm

    m = spm.ModelProto()
    m.ParseFromString(src.read_bytes())
    if vocab < len(m.pieces):
        raise ValueError(f"{src}: {len(m.pieces)} pieces, more than the vocabulary ({vocab})")
    low = min(p.score for p in m.pieces) - 1.0
    for i in range(len(m.pieces), vocab):
        p = m.pieces.add()
        p.piece, p.score, p.type = f"\u27e8{i}\u27e9", low, spm.ModelProto.SentencePiece.NORMAL
    dst.write_bytes(m.SerializeToString())


def full_vocab_dir(model: str) -> Path:
    """A random Llama (``llama110m``) as a directory for both servers: its weights and config
    linked, its 512-piece tokenizer extended to the model's vocabulary
    (``full_vocab_tokenizer``) with a LlamaTokenizer config, so every id it samples decodes to
    text (with the 512 pieces alone, almost none does)."""
    src, vocab, _ = resolve_model(model)
    return _linked_dir(
        src,
        src.with_name(src.name + "-serve-fullvocab"),
        lambda dst: full_vocab_tokenizer(STORIES / "tok512.model", vocab, dst),
    )
