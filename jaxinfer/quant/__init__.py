"""int8 quantization in the style of Google's AQT: weights (w8a16, w8a8) and KV cache pages.

- ``tensor``: the ``QTensor`` pytree and ``quantize(params, mode)``;
- ``matmul``: the quantized projection behind ``model.linear``;
- ``kv``: per-token, per-head int8 quantization of K/V;
- ``checkpoint``: saving and loading quantized params with orbax-checkpoint.
"""

from jaxinfer.quant.tensor import (
    MODES,
    QTensor,
    dequantize,
    quantize,
    quantize_tensor,
    weight_bytes,
)

__all__ = ["MODES", "QTensor", "dequantize", "quantize", "quantize_tensor", "weight_bytes"]
