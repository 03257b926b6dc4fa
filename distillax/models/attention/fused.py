"""Fused attention kernels: cuDNN flash attention (NVIDIA GPUs) and Pallas splash attention (TPU).

Never run on a real device yet. The splash path is checked against the reference path in Pallas
interpret mode on CPU (tests/models/attention/test_impls.py), and the TPU compiler (libtpu,
`plan --target`, tests/plan/test_target.py) lowers it through Mosaic for v5e, v5p and v6e. The
cuDNN path cannot run on CPU; the CUDA plugin's compiler lowers it for an H100 target when
NVIDIA's cuDNN wheel is installed (not in the test suite: a 1 GB wheel). attention_impl.choose only sends a call here when the
kernel supports what it needs, and never with a KV cache: both kernels here assume queries and
keys are the same positions (index i attends 0..i).

Both take and return the layout of layer.py: q (B, L, K, G, H) with query head k*G + g using
kv head k, keys/values (B, S, K, H). The window may be traced (scanned layers carry each layer's
span as data), but both kernels want it static, so the call switches over the distinct windows
the model has (`windows`, from its config).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from distillax.models import remat
from distillax.models.config import GLOBAL_WINDOW
from distillax.partitioning import active_rules


def over_windows(run, window, windows: tuple[int | None, ...], length: int):
  """run(static_window or None) with `window` (None, an int or traced) among `windows`."""
  as_static = lambda w: None if w is None or w >= min(length, GLOBAL_WINDOW) else int(w)
  if window is None or isinstance(window, int):
    return run(as_static(window))
  if len(windows) == 1:
    return run(as_static(windows[0]))
  table = jnp.asarray([GLOBAL_WINDOW if w is None else w for w in windows], jnp.int32)
  index = jnp.argmax(table == window)
  return jax.lax.switch(index, [lambda w=w: run(as_static(w)) for w in windows])


def per_device(local, kernel: str, q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, q_segment_BxL,
               k_segment_BxS, window):
  """`local(q, k, v, q_segment, k_segment, window)` on each device's shard: a kernel the
  compiler cannot partition (Pallas, Mosaic) runs under the active rules inside a shard_map
  over the batch and kv-head axes, and as is without rules. `kernel` names it in rule errors."""
  window = None if window is None else jnp.asarray(window, jnp.int32)
  active = active_rules()
  if active is None:
    return local(q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, q_segment_BxL, k_segment_BxS, window)
  resolve = lambda logical, x: active.rules.resolve(logical, x.shape, active.mesh, kernel)
  q_spec = resolve(("batch", None, "kv_heads", None, None), q_BxLxKxGxH)
  kv_spec = resolve(("batch", None, "kv_heads", None), k_BxSxKxH)
  seg_spec = None if q_segment_BxL is None else resolve(("batch", None), q_segment_BxL)
  window_spec = None if window is None else jax.sharding.PartitionSpec()
  sharded = jax.shard_map(local, mesh=active.mesh, check_vma=False, out_specs=q_spec,
                          in_specs=(q_spec, kv_spec, kv_spec, seg_spec, seg_spec, window_spec))
  return sharded(q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, q_segment_BxL, k_segment_BxS, window)


def cudnn_attention(q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, *, q_segment_BxL=None, k_segment_BxS=None,
                    window=None, windows=(None,), scale: float, softcap=None,
                    implementation: str = "cudnn"):
  """jax.nn.dot_product_attention(implementation='cudnn'): causal, GQA, sliding window; packed
  segments as a boolean (B, 1, L, S) mask (jax's public API has no segment ids; cuDNN turns the
  mask into a bias of the compute dtype: L x S per sequence, not per head).

  implementation='xla' runs the same call through XLA's own kernel: how the tests check the
  masks, windows, head layout and scale handed to jax on a machine without a GPU."""
  if softcap is not None:
    raise ValueError("cuDNN attention has no logit soft-cap (attention_impl.choose routes "
                     "soft-capped models to blockwise)")
  B, L, K, G, H = q_BxLxKxGxH.shape
  q_BxLxNxH = q_BxLxKxGxH.reshape(B, L, K * G, H)
  mask = None
  if q_segment_BxL is not None:
    mask = q_segment_BxL[:, None, :, None] == k_segment_BxS[:, None, None, :]

  def run(w):
    local = None if w is None else (w - 1, 0)
    return jax.nn.dot_product_attention(q_BxLxNxH, k_BxSxKxH, v_BxSxKxH, mask=mask, scale=scale,
                                        is_causal=True, local_window_size=local,
                                        implementation=implementation)

  return over_windows(run, window, windows, L).reshape(B, L, K, G, H)


def _fit(block: int, length: int) -> int:
  """`block` if it divides `length`, else the largest of 512, 256, 128 (or `length`) that does."""
  if length % block == 0 and block <= length:
    return block
  return next(b for b in (512, 256, 128, length) if length % b == 0)


def _splash_kernel(length: int, groups: int, window, softcap, interpret: bool,
                   blocks=(1024, 1024, 512), fused_bwd: bool = True):
  from jax.experimental.pallas.ops.tpu import splash_attention as sa  # TPU kernels, on demand

  if window is None:
    one = sa.CausalMask((length, length))
  else:
    one = sa.LocalMask((length, length), (window - 1, 0), offset=0)
  q, kv, kv_compute = (_fit(b, length) for b in blocks)
  kv_compute = kv_compute if kv % kv_compute == 0 else kv
  dq = {} if fused_bwd else dict(block_q_dq=q, block_kv_dq=kv)
  sizes = sa.BlockSizes(block_q=q, block_kv=kv, block_kv_compute=kv_compute, block_q_dkv=q,
                        block_kv_dkv=kv, block_kv_dkv_compute=kv_compute,
                        use_fused_bwd_kernel=fused_bwd, **dq)
  return sa.make_splash_mqa(sa.MultiHeadMask([one] * groups), block_sizes=sizes, head_shards=1,
                            q_seq_shards=1, attn_logits_soft_cap=softcap, interpret=interpret,
                            residual_checkpoint_name=remat.ATTENTION_OUT)


def _splash_local(q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, qs_BxL, ks_BxS, window, windows, scale,
                  softcap, interpret, blocks=(1024, 1024, 512), fused_bwd=True):
  """Splash on arrays this device holds whole: one MQA kernel per (batch row, kv head)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa

  B, L, K, G, H = q_BxLxKxGxH.shape
  q_BxKxGxLxH = jnp.einsum("BLKGH->BKGLH", q_BxLxKxGxH * jnp.asarray(scale, q_BxLxKxGxH.dtype))
  k_BxKxSxH = jnp.einsum("BSKH->BKSH", k_BxSxKxH)
  v_BxKxSxH = jnp.einsum("BSKH->BKSH", v_BxSxKxH)

  def run(w):
    kernel = _splash_kernel(L, G, w, softcap, interpret, blocks, fused_bwd)
    per_head = lambda q, k, v, seg: kernel(q, k, v, segment_ids=seg)
    per_row = jax.vmap(per_head, in_axes=(0, 0, 0, None))
    return jax.vmap(per_row)(q_BxKxGxLxH, k_BxKxSxH, v_BxKxSxH, sa.SegmentIds(qs_BxL, ks_BxS))

  out_BxKxGxLxH = over_windows(run, window, windows, L)
  return jnp.einsum("BKGLH->BLKGH", out_BxKxGxLxH)


def splash_attention(q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, *, q_segment_BxL=None, k_segment_BxS=None,
                     window=None, windows=(None,), scale: float, softcap=None,
                     interpret: bool = False, blocks=(1024, 1024, 512), fused_bwd: bool = True):
  """Pallas TPU splash attention: causal or local (sliding window) masks, segment ids, logit
  soft-cap. Under GSPMD rules it runs inside a shard_map over the batch and kv-head axes (a
  Pallas kernel cannot be partitioned by the compiler). interpret=True runs it on CPU.
  blocks: (block_q, block_kv, block_kv_compute); fused_bwd: one dq/dkv backward kernel."""
  B, L = q_BxLxKxGxH.shape[:2]
  if q_segment_BxL is None:
    q_segment_BxL = k_segment_BxS = jnp.ones((B, L), jnp.int32)
  local = lambda q, k, v, qs, ks, w: _splash_local(q, k, v, qs, ks, w, windows, scale, softcap,
                                                   interpret, tuple(blocks), fused_bwd)
  return per_device(local, "splash", q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, q_segment_BxL,
                    k_segment_BxS, window)
