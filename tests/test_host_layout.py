"""The engine's weight layout built with numpy (``jaxinfer.models.host_layout``) against the eager
jax
transforms it replaces (``params.unstack_layers``, ``params.out_in_projections``): same tree, same
bits, placed alike, and no XLA compilation (jax.monitoring's compile events)."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import STORIES

from jaxinfer.engine.config import EngineConfig, scan_from_tokens
from jaxinfer.models.host_layout import applies, engine_layout_on_host
from jaxinfer.models.params import OutInWeight, out_in_projections, unstack_layers


@pytest.fixture(scope="module")
def loaded():
    from jaxinfer.loaders import load

    return load(STORIES, skip_tokenizer_init=True).params


# (True, True, 128) is the CPU default (resolve)
@pytest.mark.parametrize(
    "unroll, out_in, scan", [(True, True, 128), (False, True, 128), (True, False, 64)]
)
def test_same_tree_and_bits_as_the_eager_transforms_without_compiling(loaded, unroll, out_in, scan):
    from jax import monitoring

    ecfg = EngineConfig(
        max_model_len=512, unroll_layers=unroll, out_in_weights=out_in, scan_layers_from_tokens=scan
    )
    compiles = []
    listener = lambda name, secs, **kw: compiles.append(kw.get("fun_name"))  # noqa: E731
    monitoring.register_event_duration_secs_listener(listener)
    try:
        got = engine_layout_on_host(loaded, ecfg)
    finally:
        monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    want = loaded
    if unroll is not False:
        want = unstack_layers(want, scan_from_tokens(ecfg))
    if out_in is not False:
        want = out_in_projections(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and not g.committed
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    if (unroll, out_in) == (True, True):  # the engine leaves it as it is
        again = out_in_projections(unstack_layers(got, scan_from_tokens(ecfg)))
        assert all(
            a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(got), strict=True)
        )


def test_what_it_leaves_to_the_engine(loaded):
    ecfg = EngineConfig(
        max_model_len=512, unroll_layers=True, out_in_weights=True, scan_layers_from_tokens=128
    )  # the CPU default (resolve)
    assert applies(loaded)
    done = engine_layout_on_host(loaded, ecfg)
    assert not applies(done) and engine_layout_on_host(done, ecfg) is done  # already laid out
    off = dataclasses.replace(ecfg, unroll_layers=False, out_in_weights=False)
    assert engine_layout_on_host(loaded, off) is loaded  # the engine keeps them as loaded
    committed = dataclasses.replace(loaded, embed=jax.device_put(loaded.embed, jax.devices()[0]))
    assert not applies(committed) and engine_layout_on_host(committed, ecfg) is committed
    # Weights of another type (int8 QTensor, an already converted OutInWeight): the engine's.
    converted = dataclasses.replace(
        loaded, layers=dataclasses.replace(loaded.layers, wo=OutInWeight(loaded.layers.wo, 2))
    )
    assert not applies(converted) and engine_layout_on_host(converted, ecfg) is converted
