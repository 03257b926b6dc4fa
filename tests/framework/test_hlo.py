"""The HLO collective reader against hand-written modules and against programs whose
collectives are known by construction (psum / all_gather / ppermute of known shapes)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distillax.framework import hlo

# A while loop with trip count 5 holding an all-reduce of f32[256] (1 KiB), an async all-gather
# pair bf16[1,128] -> bf16[8,128] in the entry, and a reduce-scatter f32[64] -> f32[8].
HAND_MODULE = """
HloModule jit_step, entry_computation_layout={()->f32[]}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%a, %b)
}

%body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[256]{0} get-tuple-element(%p), index=1
  %ar = f32[256]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %t = (s32[], f32[256]{0}) tuple(%i, %ar)
}

%cond (p.1: (s32[], f32[256])) -> pred[] {
  %p.1 = (s32[], f32[256]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x.1: f32[256], y: bf16[1,128], z: f32[64]) -> f32[] {
  %x.1 = f32[256]{0} parameter(0)
  %y = bf16[1,128]{1,0} parameter(1)
  %z = f32[64]{0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[256]{0}) tuple(%zero, %x.1)
  %w = (s32[], f32[256]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %ags = (bf16[1,128]{1,0}, bf16[8,128]{1,0}) all-gather-start(%y), channel_id=2, dimensions={0}
  %agd = bf16[8,128]{1,0} all-gather-done(%ags)
  %rs = f32[8]{0} reduce-scatter(%z), channel_id=3, dimensions={0}, to_apply=%add
  ROOT %r = f32[] constant(0)
}
"""


def test_shape_bytes_by_hand():
  assert hlo.shape_bytes("f32[256]{0}") == 1024
  assert hlo.shape_bytes("(bf16[8,128]{1,0}, s32[])") == 8 * 128 * 2 + 4
  assert hlo.shape_bytes("f32[]") == 4
  assert hlo.shape_bytes("token[]") == 0


def test_hand_module_counts_loops_and_async_pairs():
  stats = hlo.collective_stats(HAND_MODULE)
  assert stats["all-reduce"]["count"] == 5
  assert stats["all-reduce"]["bytes"] == 5 * 1024
  assert stats["all-gather"]["count"] == 1  # the -start/-done pair is one collective
  assert stats["all-gather"]["operand_bytes"] == 1 * 128 * 2
  assert stats["all-gather"]["result_bytes"] == 8 * 128 * 2
  assert stats["reduce-scatter"]["operand_bytes"] == 64 * 4
  assert stats["reduce-scatter"]["result_bytes"] == 8 * 4
  assert stats["reduce-scatter"]["bytes"] == 64 * 4
  assert stats["total"]["count"] == 7
  assert not stats["trip_count_unknown"]


def test_unknown_trip_count_is_flagged():
  text = HAND_MODULE.replace(', backend_config={"known_trip_count":{"n":"5"}}', "")
  stats = hlo.collective_stats(text)
  assert stats["trip_count_unknown"]
  assert stats["all-reduce"]["count"] == 1


def _mesh():
  return Mesh(np.array(jax.devices()[:8]), ("d",))


def test_compiled_psum_in_a_scan_is_counted_per_iteration():
  mesh = _mesh()

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                     check_vma=False)
  def body(x):
    def step(c, _):  # the carry feeds the psum: it cannot be hoisted out of the loop
      return jax.lax.psum(c * 0.5 + x, "d"), None
    out, _ = jax.lax.scan(step, x, None, length=3)
    return out

  x = jax.device_put(jnp.arange(8 * 1000, dtype=jnp.float32).reshape(8, 1000),
                     NamedSharding(mesh, P("d")))
  text = jax.jit(body).lower(x).compile().as_text()
  stats = hlo.collective_stats(text)
  # Each device reduces its [1, 1000] f32 block once per iteration: 3 x 4000 bytes (the scan
  # may stay a while loop or be unrolled; either way three all-reduces run).
  assert stats["all-reduce"]["count"] == 3
  assert stats["all-reduce"]["bytes"] == 3 * 4000
  assert stats["all-gather"]["count"] == 0


def test_compiled_all_gather_and_permute_bytes():
  mesh = _mesh()

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
  def body(x):
    full = jax.lax.all_gather(x, "d", tiled=True)  # [1, 16] f32 per device -> [8, 16]
    perm = jax.lax.ppermute(x, "d", [(i, (i + 1) % 8) for i in range(8)])
    return perm + full.sum(axis=0, keepdims=True)

  # f32: XLA:CPU runs bf16 collectives in f32, which would change the bytes on this backend.
  x = jax.device_put(jnp.ones((8, 16), jnp.float32), NamedSharding(mesh, P("d")))
  stats = hlo.collective_stats(jax.jit(body).lower(x).compile().as_text())
  assert stats["all-gather"]["count"] == 1
  assert stats["all-gather"]["operand_bytes"] == 16 * 4
  assert stats["all-gather"]["result_bytes"] == 8 * 16 * 4
  assert stats["collective-permute"]["count"] == 1
  assert stats["collective-permute"]["bytes"] == 16 * 4
