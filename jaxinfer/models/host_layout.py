"""The engine's weight layout transforms done with numpy on the host: no XLA compilations.

``ModelRunner.__init__`` (``jaxinfer.engine.runner``) puts loaded weights into its run layout with
eager jax ops (``params.unstack_layers``, ``params.out_in_projections``): each distinct slice,
transpose, reshape and concatenate shape is an XLA compilation of its own (a few dozen per model,
each adding to the start-up; docs/performance.md). On the CPU backend a loaded array is readable
as numpy without a copy, so ``engine_layout_on_host`` builds the same layout with numpy and places
each result with ``jax.device_put``; the engine then finds its weights already in that layout and
leaves them as they are (``unstack_layers`` only sets ``scan_from_tokens``, ``out_in_projections``
keeps ``OutInWeight``). Values are the same bits (copies, no arithmetic).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxinfer.engine.config import EngineConfig, scan_from_tokens
from jaxinfer.models.params import (
    FUSED_PROJECTIONS,
    LAYER_PROJECTIONS,
    LayerParams,
    OutInWeight,
    Params,
)


def applies(params: Params) -> bool:
    """Whether ``engine_layout_on_host`` can lay ``params`` out: the CPU backend, every weight a
    plain one-device, uncommitted jax array (not quantized, not sharded, not already converted)
    with stacked layers."""
    if jax.default_backend() != "cpu" or isinstance(params.layers, tuple):
        return False
    fields = [
        params.embed,
        params.final_norm,
        params.lm_head,
        *(getattr(params.layers, f.name) for f in dataclasses.fields(params.layers)),
    ]
    return all(
        x is None
        or (
            type(x) is not OutInWeight
            and isinstance(x, jax.Array)
            and not x.committed
            and len(x.devices()) == 1
        )
        for x in fields
    )


def engine_layout_on_host(params: Params, ecfg: EngineConfig) -> Params:
    """``params`` in the layout ``ModelRunner.__init__`` gives them on one CPU device under
    ``ecfg`` (``unroll_layers`` / ``out_in_weights``): ``out_in_projections(unstack_layers(
    params, scan_from_tokens(ecfg)))``'s tree and values, built with numpy (no XLA compile).
    Returns ``params`` unchanged where ``applies`` is False (the engine then transforms them
    itself, with the same result).

    Args:
        params: loaded weights, stacked layers (``LayerParams`` of [L, ...] arrays).
        ecfg: the engine's configuration.
    """
    if not applies(params):
        return params
    unroll, out_in = ecfg.unroll_layers, ecfg.out_in_weights
    if not (unroll or out_in):
        return params
    put = jax.device_put
    host = jax.tree.map(np.asarray, params.layers)  # views of the CPU buffers, no copies

    def output_first(w: np.ndarray, num_lead: int, num_in: int) -> np.ndarray:
        lead = list(range(num_lead))
        ins = list(range(num_lead, num_lead + num_in))
        return np.transpose(w, lead + list(range(num_lead + num_in, w.ndim)) + ins)

    def layer(lp: LayerParams, num_lead: int) -> LayerParams:
        """One layer (num_lead 0) or the stacked layers (1) as numpy views -> placed arrays."""
        moved = LAYER_PROJECTIONS if out_in else {}  # laid out below
        new = {
            f.name: None if getattr(lp, f.name) is None else put(getattr(lp, f.name))
            for f in dataclasses.fields(lp)
            if f.name not in moved or getattr(lp, f.name) is None
        }
        if not out_in:
            return LayerParams(**new)
        views = {
            n: output_first(getattr(lp, n), num_lead, k)
            for n, k in LAYER_PROJECTIONS.items()
            if getattr(lp, n) is not None  # no dense MLP when every layer is sparse
        }
        for fused, names in FUSED_PROJECTIONS.items():  # as out_in_projections: one GEMM each
            if not all(n in views for n in names):
                continue
            ws = [views.pop(n) for n in names]
            lead = ws[0].shape[:num_lead]
            parts = tuple(w.shape[num_lead:-1] for w in ws)
            flat = [w.reshape(*lead, -1, w.shape[-1]) for w in ws]
            new[fused] = OutInWeight(put(np.concatenate(flat, axis=num_lead)), 1, parts)
            new.update({n: None for n in names})
        for n, w in views.items():
            new[n] = OutInWeight(put(np.ascontiguousarray(w)), LAYER_PROJECTIONS[n])
        return LayerParams(**new)

    if unroll:
        n = jax.tree.leaves(host)[0].shape[0]
        layers = tuple(layer(jax.tree.map(lambda a, i=i: a[i], host), 0) for i in range(n))
        return dataclasses.replace(params, layers=layers, scan_from_tokens=scan_from_tokens(ecfg))
    return dataclasses.replace(params, layers=layer(host, 1))
