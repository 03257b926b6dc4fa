"""MXFP4-packed expert weights (the released gpt-oss checkpoints), dequantized on load.

gpt-oss ships each layer's expert matrices as `<name>_blocks` (uint8, (E, out, in / 32, 16): two
4-bit e2m1 codes per byte, the low nibble first) and `<name>_scales` (uint8, (E, out, in / 32):
one power-of-two exponent per 32 codes, e8m0 with bias 127), with `quantization_config`
{"quant_method": "mxfp4"} in config.json. Each value is FP4_VALUES[code] * 2**(scale - 127),
exactly representable in float32. The dequantized tensor is HF's unquantized one, (E, in, out)
(transformers' integrations/mxfp4.py: `convert_moe_packed_tensors`). numpy only: a loader reads
just the experts and output rows of its shard.
"""

from __future__ import annotations

import numpy as np

QUANT_METHOD = "mxfp4"
BLOCK = 32  # values per shared scale
# e2m1 codes 0..15: sign bit 3, then the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
SCALE_BIAS = 127


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """float32 (..., R, G * 32) of blocks (..., R, G, 16) and scales (..., R, G): the rows as
  stored (HF's tensor is its transpose over the last two axes)."""
  blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
  if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
    raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair: "
                     f"blocks must be scales' shape + ({BLOCK // 2},)")
  codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # low nibble = the even element
  values = FP4_VALUES[codes].reshape(scales.shape + (BLOCK,))
  values = np.ldexp(values, scales.astype(np.int32)[..., None] - SCALE_BIAS)
  return values.reshape(scales.shape[:-1] + (scales.shape[-1] * BLOCK,))


def packed_names(name: str) -> tuple[str, str]:
  """The blocks and scales tensors that hold HF tensor `name` in an MXFP4 checkpoint."""
  return f"{name}_blocks", f"{name}_scales"


class PackedTensor:
  """What safetensors' slice handle is to a plain tensor, for an MXFP4 pair: `get_shape()` is
  the dequantized (E, in, out), and `[e, i, o]` reads only the experts e and stored rows o."""

  def __init__(self, blocks, scales):
    self.blocks, self.scales = blocks, scales  # safetensors slice handles (or arrays)

  def get_shape(self) -> list[int]:
    E, R, G, _ = self.blocks.get_shape()
    return [E, G * BLOCK, R]

  def __getitem__(self, index):
    index = tuple(index) if isinstance(index, tuple) else (index,)
    index += (slice(None),) * (3 - len(index))
    experts, inputs, outputs = index
    every = slice(None)
    rows = dequantize(self.blocks[experts, outputs, every, every],
                      self.scales[experts, outputs, every])
    return np.swapaxes(rows, -1, -2)[:, inputs]
