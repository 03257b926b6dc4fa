"""tokamax's flash attention (`model.attention_impl='tokamax'`, the optional `tokamax` extra):
its Mosaic GPU kernel on an NVIDIA GPU (sm90 / sm100: H100, H200, B200), its XLA path on CPU
(how the tests check the masks, windows, head layout and scale handed to it). Not yet run on a
GPU: the CUDA plugin's deviceless compile for an H100 lowers it to `mosaic_gpu` custom calls,
forward and backward (`plan --target gpu:h100x1`, tests/plan/test_target.py).

Takes and returns the layout of layer.py: q (B, L, K, G, H) with query head k*G + g using kv
head k, keys/values (B, S, K, H); causal, sliding window, logit soft-cap; packed segments as a
boolean (B, 1, L, S) mask, as the cuDNN path (tokamax's public API has no segment ids). Under
GSPMD rules the kernel runs inside a shard_map over the batch and kv-head axes: a Pallas kernel
is not partitioned by the compiler.
"""

from __future__ import annotations

from distillax.models import tokamax_support
from distillax.models.attention.fused import over_windows, per_device
from distillax.models.attention.impl import compile_platform

TOKAMAX_MISSING = ("model.attention_impl='tokamax' needs the tokamax package (pip install "
                   "'distillax[tokamax]'); or set --config.model.attention_impl=auto")
# tokamax's implementation by the platform the step compiles for; elsewhere its XLA path.
KERNELS = {"gpu": "mosaic_gpu"}


def _local(q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, qs_BxL, ks_BxS, window, windows, scale, softcap,
           implementation, device):
  tokamax = tokamax_support.import_tokamax(TOKAMAX_MISSING)
  B, L, K, G, H = q_BxLxKxGxH.shape
  q_BxLxNxH = q_BxLxKxGxH.reshape(B, L, K * G, H)
  mask = None if qs_BxL is None else qs_BxL[:, None, :, None] == ks_BxS[:, None, None, :]

  def run(w):
    local = None if w is None else (w - 1, 0)
    attend = lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=True, local_window_size=local,
        logits_soft_cap=softcap, implementation=implementation)
    return tokamax_support.traced_on(device, attend)(q_BxLxNxH, k_BxSxKxH, v_BxSxKxH)

  return over_windows(run, window, windows, L).reshape(B, L, K, G, H)


def tokamax_attention(q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, *, q_segment_BxL=None,
                      k_segment_BxS=None, window=None, windows=(None,), scale: float,
                      softcap=None, implementation: str | None = None):
  """implementation: tokamax's; None: by the platform the step compiles for (KERNELS)."""
  implementation = implementation or KERNELS.get(compile_platform(), "xla")
  device = tokamax_support.target_device()
  local = lambda q, k, v, qs, ks, w: _local(q, k, v, qs, ks, w, windows, scale, softcap,
                                            implementation, device)
  return per_device(local, "tokamax", q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, q_segment_BxL,
                    k_segment_BxS, window)
