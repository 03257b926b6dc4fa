"""One test, two machines: what the hardware-dependent tests change when scripts/chip_tests.sh runs
them on a TPU (JAX_PLATFORMS=tpu,cpu set before pytest starts).

The chip run's tests (scripts/chip_tests.py, SELECTION) are the CPU suite's own. On a TPU they
take the real kernels (splash attention through Mosaic instead of the Pallas interpreter,
tokamax's Mosaic grouped matmul and fused loss instead of their XLA paths), sizes those kernels
tile (sequences of 2048, matmul dimensions of at least 128, block remainders as the real
vocabularies have), and the tolerances a TPU's arithmetic meets. On CPU nothing changes: the same
assertions at the suite's own sizes and tolerances.

Tolerances on a TPU, and why:
- float32 under jax_default_matmul_precision='highest' (tests/conftest.py): XLA runs an f32
  matmul as six bf16 passes and Mosaic with fp32 contract precision, so products are about
  float32's, not CPU's bit for bit; exp, log and tanh are the TPU's approximations (a few ulp);
  sums reduce in another order. Those errors scale with the magnitudes an array sums, not with
  each element (an elementwise rtol fails on a gradient's near-zero entries), so each array is
  compared as max |got - want| <= F32 * max |want|. F32 = 1e-4: 10-100x the ~1e-6 relative
  error expected of float32 arithmetic summed over up to a few thousand terms, and 40x under
  bfloat16's (a kernel that silently ran float32 in one bf16 pass, ~4e-3, fails).
- A whole model's float32 gradients compared engine against engine (F32_GRADS = 3e-4): each
  engine on the chip is itself up to ~1e-4 of each gradient's scale off the CPU's (call 39:
  on-policy forward KL through the whole logits 1.0e-4, over slices 8.9e-5; the jsd through the
  whole logits 4.6e-5), so two of them differ by up to twice that. The jsd over slices against
  the whole logits on the chip: 1.0e-4 and 1.1e-4 once its terms came from the logits'
  difference (call 40; 3.0e-4 before); its per-column terms on the TPU's exp, expm1 and log1p
  alone were 1.1e-4 of the gradient's scale off float64 (call 40). Still 13x under a bfloat16
  pass's ~4e-3.
- bfloat16 runs at the default precision, as a training step does: the MXU multiplies bf16
  exactly and sums in float32; what is lost is each rounding to bf16 (probabilities, hidden
  activations, the kernels' outputs: 2^-9 relative each). Compared with the float32 result of
  the same bf16-rounded inputs (`assert_bf16`): ||got - want|| <= BF16 ||want|| and
  max |got - want| <= BF16_MAX max |want|. Measured on CPU, whose bf16 products and float32
  sums are the MXU's (the Pallas interpreter for splash): splash attention at most 3.6e-3 (norm)
  and 5.5e-3 (max), the reference attention in bf16 alike; the grouped matmuls at the chip's
  shapes 6.0e-3 and 1.0e-2, the dense reference in bf16 the same 1.0e-2. BF16 = 2e-2 and
  BF16_MAX = 6e-2 leave 3-6x; a wrong block, mask or group is off by far more (tens of %).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

F32 = 1e-4
F32_GRADS = 3e-4
BF16 = 2e-2
BF16_MAX = 6e-2


@functools.cache
def on_tpu() -> bool:
  """JAX's default backend is a TPU: the chip run (scripts/chip_tests.sh --tpu)."""
  return jax.default_backend() == "tpu"


def interpret() -> bool:
  """Pallas kernels: the real Mosaic kernel on a TPU, the Pallas interpreter elsewhere."""
  return not on_tpu()


def pick(cpu, tpu):
  """`tpu` on the chip, `cpu` elsewhere (sizes, a model config)."""
  return tpu if on_tpu() else cpu


def precision(dtype):
  """The matmul precision a comparison in `dtype` runs at: 'highest' for float32 (the suite's
  own, tests/conftest.py), the default for bfloat16 (what a training step runs; and Mosaic
  refuses a bf16 matmul at fp32 contract precision: "Bad lhs type", seen in libtpu 0.0.42.1's
  deviceless compiles of splash attention and tokamax's fused loss)."""
  if jnp.dtype(dtype) == jnp.float32:
    return contextlib.nullcontext()
  return jax.default_matmul_precision("default")


def scaled_error(got, want) -> float:
  """max |got - want| / max |want| (the largest error relative to the array's scale)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = np.abs(want).max()
  return float(np.abs(got - want).max() / (scale if scale > 0 else 1.0))


def assert_scaled(got, want, tol: float, err_msg: str = "") -> None:
  """max |got - want| <= tol * max |want|, on every platform."""
  assert np.shape(got) == np.shape(want), (err_msg, np.shape(got), np.shape(want))
  error = scaled_error(got, want)
  assert error <= tol, (f"{err_msg}: max |got - want| = {error:.3g} x max |want| > {tol:g} "
                        f"(max |want| {np.abs(np.asarray(want, np.float64)).max():.3g})")


def assert_close(got, want, *, dtype="float32", tpu: float = F32, err_msg: str = "",
                 **cpu) -> None:
  """A result computed in `dtype`: bfloat16 by assert_bf16 everywhere; float32 on CPU by
  np.testing.assert_allclose(got, want, **cpu), the suite's own check, and on a TPU by
  assert_scaled(got, want, tpu) (the module docstring says why)."""
  if jnp.dtype(dtype) == jnp.bfloat16:
    assert_bf16(got, want, err_msg)
  elif on_tpu():
    assert_scaled(got, want, tpu, err_msg)
  else:
    np.testing.assert_allclose(got, want, err_msg=err_msg, **cpu)


def assert_bf16(got, want, err_msg: str = "", norm: float = BF16,
                largest: float = BF16_MAX) -> None:
  """A bfloat16 result against the float32 one of the same rounded inputs (module docstring),
  on every platform: ||got - want|| <= norm ||want||, max |got - want| <= largest max |want|."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (err_msg, got.shape, want.shape)
  error = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
  assert error <= norm, f"{err_msg}: ||got - want|| = {error:.3g} x ||want|| > {norm:g}"
  assert_scaled(got, want, largest, err_msg)
