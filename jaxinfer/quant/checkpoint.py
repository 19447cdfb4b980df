"""Saving and loading quantized params with orbax-checkpoint (``jaxinfer quantize``).

A quantized checkpoint is a directory:

- ``jaxinfer_quant.json``: format name and version, the ``ModelConfig``, the quantization mode,
  which weights are quantized, every array's shape, dtype and sha256, and the source checkpoint's
  identity (path, size and sha256 of each file it was read from);
- ``params/``: an orbax PyTree checkpoint of the flat arrays (``"layers.wq.values"``,
  ``"layers.wq.scales"``, ``"embed"``, ...), one zarr array directory each (OCDBT off, so a
  missing or damaged array is named by its own directory);
- the source's tokenizer files, copied, so ``jaxinfer.load(DIR)`` finds them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import CheckpointError
from jaxinfer.loaders.checks import check_fits
from jaxinfer.loaders.detect import detect_format
from jaxinfer.loaders.llama2c import is_llama2c_tokenizer_file
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.params import LayerParams, Params, param_shapes
from jaxinfer.models.rope import RopeScaling
from jaxinfer.quant.tensor import MODES, QTensor, quant_mode

METADATA_FILE = "jaxinfer_quant.json"
FORMAT_NAME = "jaxinfer-quantized"
FORMAT_VERSION = 1
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def _flatten(params: Params) -> tuple[dict[str, jax.Array], dict[str, int]]:
    """({"embed": a, "layers.wq.values": v, "layers.wq.scales": s, ...}, {field: num_in})."""
    if isinstance(params.layers, tuple):
        raise ValueError("save stacked params (before unstack_layers)")
    flat, quantized = {}, {}
    fields = {"embed": params.embed, "final_norm": params.final_norm, "lm_head": params.lm_head}
    fields.update(
        {
            f"layers.{f.name}": getattr(params.layers, f.name)
            for f in dataclasses.fields(LayerParams)
        }
    )
    for name, x in fields.items():
        if x is None:
            continue
        if isinstance(x, QTensor):
            flat[f"{name}.values"], flat[f"{name}.scales"] = x.values, x.scales
            quantized[name] = x.num_in
        else:
            flat[name] = x
    return flat, quantized


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def source_identity(path: str | os.PathLike) -> dict:
    """Path and (name, bytes, sha256) of each weight/config file of a source checkpoint."""
    fmt, ckpt = detect_format(path)
    if fmt == "hf":
        files = sorted(
            [
                ckpt / "config.json",
                *ckpt.glob("*.safetensors"),
                *ckpt.glob("*.safetensors.index.json"),
            ]
        )
    elif fmt == "llama2c":
        files = [ckpt]
    else:
        files = [ckpt / METADATA_FILE]
    return {
        "path": str(Path(path).resolve()),
        "format": fmt,
        "files": [{"name": f.name, "bytes": f.stat().st_size, "sha256": _sha256(f)} for f in files],
    }


def _config_to_json(cfg: ModelConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["layer_windows"] = list(cfg.layer_windows)
    return d


def _config_from_json(d: dict) -> ModelConfig:
    """The ModelConfig of the metadata's "config" (ValueError/TypeError when malformed)."""
    if not isinstance(d, dict):
        raise ValueError(f"expected a JSON object, found {type(d).__name__}")
    d = dict(d)
    if d.get("rope_scaling") is not None:
        if not isinstance(d["rope_scaling"], dict):
            raise ValueError(f"rope_scaling must be an object, found {d['rope_scaling']!r}")
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    # Written in full by save_quantized: required, so num_layers cannot make a huge default.
    if not isinstance(d.get("layer_windows"), list):
        raise ValueError("layer_windows must be a list with one window per layer")
    d["layer_windows"] = tuple(d["layer_windows"])
    return ModelConfig(**d)


def _expected_arrays(cfg: ModelConfig, quantized: dict) -> dict[str, tuple[int, ...]]:
    """Shape of every array a checkpoint of ``cfg`` holds: ``param_shapes``, quantized fields
    as ``.values`` [*lead, *out, *in] and ``.scales`` [*lead, *out] (``quantize_tensor``)."""
    out = {}
    for field, s in param_shapes(cfg).items():
        if field not in quantized:
            out[field] = s
            continue
        k = quantized[field]
        lead = 1 if field.startswith("layers.") else 0
        if field in ("layers.expert_gate_up", "layers.expert_down"):
            lead = 2  # [L, E, *in, *out]: scales per layer, expert and output channel
        src = s[::-1] if field == "embed" else s  # the embedding is quantized as embed.T
        out[f"{field}.values"] = src[:lead] + src[lead + k :] + src[lead : lead + k]
        out[f"{field}.scales"] = src[:lead] + src[lead + k :]
    return out


def _check_arrays(meta: dict, cfg: ModelConfig, f: Path) -> None:
    """The metadata's arrays are exactly those of ``cfg`` (names and shapes), with known dtypes;
    CheckpointError naming the array otherwise."""
    quantized, arrays = meta["quantized"], meta["arrays"]
    if not isinstance(quantized, dict) or not all(
        v in (1, 2) and not isinstance(v, bool) for v in quantized.values()
    ):
        raise CheckpointError(f"{f}: 'quantized' must map fields to their input axes (1 or 2)")
    if not isinstance(arrays, dict) or not all(
        isinstance(a, dict) and isinstance(a.get("shape"), list) for a in arrays.values()
    ):
        raise CheckpointError(f"{f}: 'arrays' must map names to objects with a 'shape' list")
    expected = _expected_arrays(cfg, quantized)
    for name, spec in arrays.items():
        if name not in expected:
            raise CheckpointError(
                f"{f}: array {name!r} is not used by the model its config describes (expected "
                f"arrays: {', '.join(sorted(expected))})"
            )
        if tuple(spec["shape"]) != expected[name]:
            raise CheckpointError(
                f"{f}: array {name!r} has shape {spec['shape']}, the config implies "
                f"{list(expected[name])}"
            )
        try:
            if not isinstance(spec.get("dtype"), str):
                raise TypeError
            jnp.dtype(spec["dtype"])
        except TypeError:
            raise CheckpointError(f"{f}: array {name!r} has dtype {spec.get('dtype')!r}") from None
    missing = sorted(set(expected) - set(arrays))
    if missing:
        raise CheckpointError(f"{f}: array {missing[0]!r} is missing from the metadata")


def _copy_tokenizer(src: str | os.PathLike, out: Path) -> list[str]:
    fmt, ckpt = detect_format(src)
    d = ckpt if ckpt.is_dir() else ckpt.parent
    names = [n for n in TOKENIZER_FILES if (d / n).is_file()]
    names += [f.name for f in d.glob("*.model") if f.name not in names]
    names += [f.name for f in d.glob("*.bin") if is_llama2c_tokenizer_file(f)]
    if fmt == "hf":  # the tokenizer reads special-token ids from config.json too
        names.append("config.json")
    for n in names:
        shutil.copyfile(d / n, out / n)
    return names


def save_quantized(
    out: str | os.PathLike,
    cfg: ModelConfig,
    params: Params,
    source: str | os.PathLike | None = None,
    *,
    embed: bool = False,
    lm_head: bool = False,
) -> Path:
    """Writes quantized ``params`` to directory ``out`` (created; must not hold a checkpoint).

    Args:
        out: output directory.
        cfg: the model's architecture.
        params: quantized params (``quantize``).
        source: the checkpoint they were made from: its identity is recorded and its tokenizer
            files are copied.
        embed, lm_head: recorded as given to ``quantize``.

    Raises:
        ValueError: params are not quantized, or ``out`` already holds a checkpoint.
    """
    import orbax.checkpoint as ocp

    mode = quant_mode(params)
    if mode is None:
        raise ValueError("params are not quantized; call jaxinfer.quant.quantize first")
    out = Path(out).resolve()
    if (out / METADATA_FILE).exists() or (out / "params").exists():
        raise ValueError(f"{out} already holds a checkpoint; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    flat, quantized = _flatten(params)
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "quantization": mode,
        "embed": embed,
        "lm_head": lm_head,
        "dtype": str(jnp.dtype(params.embed.dtype)),
        "config": _config_to_json(cfg),
        "quantized": quantized,
        "arrays": {
            k: {"shape": list(v.shape), "dtype": str(v.dtype), "sha256": _digest(v)}
            for k, v in flat.items()
        },
        "source": source_identity(source) if source is not None else None,
        "tokenizer_files": _copy_tokenizer(source, out) if source is not None else [],
    }
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))
    with _without_absl_warning(_NO_OCDBT_TO_MERGE):
        ckptr.save(out / "params", args=ocp.args.PyTreeSave(flat))
    (out / METADATA_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return out


_NO_OCDBT_TO_MERGE = "Skipping merge of OCDBT checkpoints: No per-process OCDBT checkpoint subdirs"
"""The start of the WARNING orbax logs at the end of every save without OCDBT: its finalize step
always tries to merge per-process OCDBT files, and with ``use_ocdbt=False`` (one zarr directory
per array, by design) there are none. It says nothing is wrong, so it is not shown."""


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def _without_absl_warning(text: str):
    """Drops the absl log records (orbax logs through absl) that contain ``text``; every other
    record, at every level, passes."""
    log = logging.getLogger("absl")
    drop = _DropMessage(text)
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def _restore_args(names) -> dict:
    """Restore every array onto the first local device (``load_quantized`` is single-device), so
    orbax does not read each array's sharding back from the file and warn that doing so is unsafe
    on another topology than the one that saved it."""
    import orbax.checkpoint as ocp

    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return {n: ocp.ArrayRestoreArgs(sharding=one) for n in names}


def _digest(x) -> str:
    """sha256 of an array's bytes (C order): the integrity check of each saved array."""
    return hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest()


def read_metadata(path: str | os.PathLike) -> dict:
    """The checked metadata of a quantized checkpoint directory. Raises CheckpointError."""
    f = Path(path) / METADATA_FILE
    try:
        meta = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or UTF-8
        raise CheckpointError(
            f"{f}: cannot read quantized-checkpoint metadata: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{f}: expected a JSON object, found {type(meta).__name__}")
    if meta.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{f}: format {meta.get('format')!r}, expected {FORMAT_NAME!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{f}: format_version {meta.get('format_version')!r} is not supported by this "
            f"jaxinfer (reads version {FORMAT_VERSION}); re-run `jaxinfer quantize` on the source"
        )
    if meta.get("quantization") not in MODES:
        raise CheckpointError(f"{f}: quantization {meta.get('quantization')!r}; supported: {MODES}")
    for key in ("config", "arrays", "quantized", "dtype"):
        if key not in meta:
            raise CheckpointError(f"{f}: missing key {key!r}")
    return meta


def load_quantized(path: str | os.PathLike, dtype=None, place=None) -> tuple[ModelConfig, Params]:
    """Loads a ``save_quantized`` directory: int8 weights stay int8.

    Args:
        path: the checkpoint directory.
        dtype: float dtype of activations and unquantized tensors (None: as saved).
        place: the loaders' placement hook; only single-device placement is supported.

    Raises:
        CheckpointError: bad metadata (format, version, mode), or an array that is missing,
            unreadable (truncated) or of the wrong shape/dtype -- the message names its file.
        ValueError: ``place`` asks for a multi-device mesh.
    """
    import orbax.checkpoint as ocp

    path = Path(path)
    meta = read_metadata(path)
    try:
        cfg = _config_from_json(meta["config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path / METADATA_FILE}: bad config: {e}") from None
    _check_arrays(meta, cfg, path / METADATA_FILE)
    try:
        fdtype = jnp.dtype(dtype) if dtype is not None else jnp.dtype(meta["dtype"])
    except TypeError:
        raise CheckpointError(f"{path / METADATA_FILE}: dtype {meta['dtype']!r}") from None
    nbytes = sum(
        math.prod(a["shape"]) * jnp.dtype(a["dtype"]).itemsize for a in meta["arrays"].values()
    )
    check_fits(path, nbytes, 0, "the arrays")
    if place is not None and hasattr(place, "setup"):
        place.setup(cfg, np.dtype(meta["dtype"]))
        if getattr(place, "mesh", None) is not None:
            raise ValueError(
                "quantized checkpoints load on one device; tensor/data parallel "
                "int8 is not supported yet"
            )
    pdir = path / "params"
    for name, spec in meta["arrays"].items():
        adir = pdir / name
        if not (adir / ".zarray").is_file() or not any(adir.glob("[0-9]*")):
            raise CheckpointError(f"{adir}: array {name!r} is missing from the checkpoint")
        try:  # restore allocates what .zarray says: check it before
            shape = json.loads((adir / ".zarray").read_text()).get("shape")
        except (OSError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{adir / '.zarray'}: unreadable: {e}") from None
        if shape != spec["shape"]:
            raise CheckpointError(
                f"{adir / '.zarray'}: shape {shape}, metadata says {spec['shape']}"
            )
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))
    try:
        flat = ckptr.restore(
            pdir.resolve(),
            args=ocp.args.PyTreeRestore(restore_args=_restore_args(meta["arrays"])),
        )
    except Exception as e:  # orbax/tensorstore raise many types; name the directory either way
        msg = str(e)
        for cut in ("See full TensorStore details", "[source locations="):
            msg = msg.split(cut)[0]  # tensorstore's spec dump and C++ source lines
        first = " ".join(msg.split())[:300]
        named = sorted((n for n in meta["arrays"] if f"/{n}/" in str(e)), key=len)
        where = pdir / named[-1] if named else pdir
        raise CheckpointError(
            f"{where}: cannot read the array{'' if named else 's'} (a file under it is truncated "
            f"or corrupt; re-run `jaxinfer quantize`): {type(e).__name__}: {first}"
        ) from None
    for name, spec in meta["arrays"].items():
        x = flat.get(name)
        if x is None:
            raise CheckpointError(f"{pdir / name}: array {name!r} is missing")
        if list(x.shape) != spec["shape"] or str(x.dtype) != spec["dtype"]:
            raise CheckpointError(
                f"{pdir / name}: {x.dtype}{list(x.shape)}, "
                f"metadata says {spec['dtype']}{spec['shape']}"
            )
        if "sha256" in spec and _digest(x) != spec["sha256"]:
            raise CheckpointError(
                f"{pdir / name}: array {name!r} is corrupt (its sha256 differs from the one "
                f"recorded in {METADATA_FILE} at save time); re-run `jaxinfer quantize`"
            )
        if jnp.issubdtype(x.dtype, jnp.floating) and not bool(jnp.isfinite(x).all()):
            bad = int(x.size - jnp.isfinite(x).sum())
            raise CheckpointError(
                f"{pdir / name}: array {name!r} holds {bad} non-finite value(s) (NaN or Inf)"
            )
    act = "int8" if meta["quantization"] == "w8a8" else "float"

    def field(name):
        if name in meta["quantized"]:
            return QTensor(
                flat[f"{name}.values"],
                flat[f"{name}.scales"],
                int(meta["quantized"][name]),
                act,
                fdtype,
            )
        x = flat.get(name)
        return None if x is None else x.astype(fdtype)

    layers = LayerParams(
        **{f.name: field(f"layers.{f.name}") for f in dataclasses.fields(LayerParams)}
    )
    params = Params(
        embed=field("embed"),
        layers=layers,
        final_norm=field("final_norm"),
        lm_head=field("lm_head"),
    )
    return cfg, params
