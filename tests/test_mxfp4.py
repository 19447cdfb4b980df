"""MXFP4 dequantization (jaxinfer/loaders/mxfp4.py) == transformers' ``convert_moe_packed_tensors``
(integrations/mxfp4.py) bit for bit, on random blocks and scales; bad shapes name the tensor."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jaxinfer.errors import CheckpointError
from jaxinfer.loaders.mxfp4 import dequantize_expert_weight, dequantize_mxfp4

torch = pytest.importorskip("torch")
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

DTYPES = {
    "float32": (np.float32, torch.float32, np.uint32, torch.int32),
    "bfloat16": (ml_dtypes.bfloat16, torch.bfloat16, np.uint16, torch.int16),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_expert_weight_equals_transformers_bit_for_bit(dtype):
    np_dt, torch_dt, bits, torch_bits = DTYPES[dtype]
    rng = np.random.default_rng(0)
    e, r, g = 3, 10, 4
    blocks = rng.integers(0, 256, (e, r, g, 16), dtype=np.uint8)
    # every exponent: 0 (2**-127, subnormal in float32), 127 (1.0), 254 (2**127), 255 (2**128:
    # inf unless the FP4 value is 0 or 0.5)
    scales = rng.integers(0, 256, (e, r, g), dtype=np.uint8)
    scales[0, :4, 0] = [0, 127, 254, 255]
    ours = dequantize_expert_weight(blocks, scales, np_dt, where="f", name="w")
    ref = mxfp4.convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch_dt
    )
    assert ours.shape == tuple(ref.shape) == (e, g * 32, r)
    assert ours.dtype == np.dtype(np_dt)
    np.testing.assert_array_equal(ours.view(bits), ref.view(torch_bits).numpy().view(bits))


def test_typical_scales_and_nibble_order():
    """Scales near 127 (as checkpoints hold), and one hand-made byte: 0x72 is low nibble 2 (1.0)
    at the even element, high nibble 7 (6.0) at the odd one."""
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (2, 5, 3, 16), dtype=np.uint8)
    scales = rng.integers(117, 137, (2, 5, 3), dtype=np.uint8)
    ref = mxfp4.convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    )
    np.testing.assert_array_equal(dequantize_expert_weight(blocks, scales), ref.numpy())
    one = dequantize_mxfp4(
        np.full((1, 1, 16), 0x72, np.uint8), np.full((1, 1), 128, np.uint8), np.float32
    )
    np.testing.assert_array_equal(one[0, :4], [2.0, 12.0, 2.0, 12.0])


@pytest.mark.parametrize(
    "blocks_shape,scales_shape,blocks_dtype,bad",
    [
        ((2, 4, 3, 8), (2, 4, 3), np.uint8, "w_blocks"),  # 8 bytes a block
        ((2, 4, 3, 16), (2, 4, 2), np.uint8, "w_scales"),  # one scale short
        ((2, 4, 3, 16), (2, 4, 3), np.int8, "w_blocks"),
        ((4, 3, 16), (4, 3), np.uint8, "w_blocks"),  # not [E, R, G, 16]
    ],
)
def test_bad_blocks_or_scales_name_file_and_tensor(blocks_shape, scales_shape, blocks_dtype, bad):
    blocks = np.zeros(blocks_shape, blocks_dtype)
    scales = np.zeros(scales_shape, np.uint8)
    with pytest.raises(CheckpointError, match=rf"model-00001\.safetensors: tensor '{bad}'"):
        dequantize_expert_weight(blocks, scales, where="model-00001.safetensors", name="w")
