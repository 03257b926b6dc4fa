"""The HLO collective reader against hand-written modules and against programs whose
collectives are known by construction (psum / all_gather / ppermute of known shapes)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distillax.framework import hlo, hlo_flops

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


# The shapes the TPU compiler gives a scanned loop and an FSDP gradient reduction (no
# known_trip_count; the counter's start reached through a copy; an all-reduce-scatter fusion
# whose all-reduce of f32[64,16] is sliced to f32[16,16] per device), and XLA:CPU's wrapped
# compare. The loop runs 6 - 2 = 4 times; its body holds a dot f32[8,32] x f32[32,16].
TPU_STYLE_MODULE = """
HloModule jit_step, entry_computation_layout={()->f32[]}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%a, %b)
}

%all-reduce-scatter.3 (input_0: f32[64,16]) -> f32[16,16] {
  %input_0 = f32[64,16]{1,0:T(8,128)} parameter(0)
  %all-reduce.9 = f32[64,16]{1,0:T(8,128)} all-reduce(%input_0), channel_id=4, to_apply=%add
  %pid = u32[] partition-id()
  %zero.2 = u32[] constant(0)
  ROOT %ds = f32[16,16]{1,0:T(8,128)} dynamic-slice(%all-reduce.9, %pid, %zero.2), dynamic_slice_sizes={16,16}
}

%body (p: (s32[], f32[8,32], f32[32,16])) -> (s32[], f32[8,32], f32[32,16]) {
  %p = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,32]{1,0} get-tuple-element(%p), index=1
  %w = f32[32,16]{1,0} get-tuple-element(%p), index=2
  %d = f32[8,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ag = f32[64,16]{1,0} all-gather(%d), channel_id=5, dimensions={0}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) tuple(%next, %x, %w)
}

%cond (p.1: (s32[], f32[8,32], f32[32,16])) -> pred[] {
  %p.1 = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) parameter(0)
  %limit = s32[]{:T(128)} constant(6)
  %gte = s32[] get-tuple-element(%p.1), index=0
  ROOT %lt = pred[] compare(%gte, %limit), direction=LT
}

%wrapped_compare_computation (c0: s32[], c1: s32[]) -> pred[] {
  %c0 = s32[] parameter(0)
  %c1 = s32[] parameter(1)
  ROOT %cmp = pred[] compare(%c1, %c0), direction=GT
}

%cond.cpu (p.2: (s32[], f32[8,32], f32[32,16])) -> pred[] {
  %p.2 = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) parameter(0)
  %gte.2 = s32[] get-tuple-element(%p.2), index=0
  %limit.2 = s32[] constant(3)
  ROOT %wrapped_compare = pred[] fusion(%gte.2, %limit.2), kind=kLoop, calls=%wrapped_compare_computation
}

ENTRY %main (x.1: f32[8,32], w.1: f32[32,16], g: f32[64,16]) -> f32[] {
  %x.1 = f32[8,32]{1,0} parameter(0)
  %w.1 = f32[32,16]{1,0} parameter(1)
  %g = f32[64,16]{1,0} parameter(2)
  %two = s32[] constant(2)
  %start = s32[] copy(%two)
  %init = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) tuple(%start, %x.1, %w.1)
  %loop = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) while(%init), condition=%cond, body=%body
  %zero = s32[] constant(0)
  %init.cpu = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) tuple(%zero, %x.1, %w.1)
  %loop.cpu = (s32[], f32[8,32]{1,0}, f32[32,16]{1,0}) while(%init.cpu), condition=%cond.cpu, body=%body
  %fusion.7 = f32[16,16]{1,0} fusion(%g), kind=kCustom, calls=%all-reduce-scatter.3, backend_config={"collective_algorithm_config":{"emitter":"AllReduceScatterFusion"}}
  ROOT %r = f32[] constant(0)
}
"""


def test_trip_counts_read_from_the_loop_condition():
  """4 iterations (2 up to < 6) plus 3 (0 up to 3 > counter, XLA:CPU's wrapped compare): the
  body's all-gather of f32[64,16] runs 7 times."""
  stats = hlo.collective_stats(TPU_STYLE_MODULE)
  assert not stats["trip_count_unknown"]
  assert stats["all-gather"]["count"] == 7
  assert stats["all-gather"]["result_bytes"] == 7 * 64 * 16 * 4


def test_all_reduce_scatter_fusion_is_a_reduce_scatter():
  stats = hlo.collective_stats(TPU_STYLE_MODULE)
  assert stats["all-reduce"]["count"] == 0
  rs = stats["reduce-scatter"]
  assert rs["count"] == 1
  assert (rs["operand_bytes"], rs["result_bytes"]) == (64 * 16 * 4, 16 * 16 * 4)


def test_matmul_flops_count_each_loop_iteration():
  """2 x 8 x 16 x 32 FLOPs per dot, 7 iterations in all."""
  assert hlo_flops.matmul_flops(TPU_STYLE_MODULE) == {"flops": 7 * 2 * 8 * 16 * 32,
                                                "trip_count_unknown": False}


def test_matmul_flops_of_a_tpu_convolution_written_dot():
  """The TPU compiler writes [32,64] x [64,2,16] -> [32,2,16] as a convolution over a size-1
  spatial dim with a width-2 window padded 1_1: one kernel position per output is real, so
  2 x 32 x 2 x 16 x 64 FLOPs, not twice that."""
  text = """
ENTRY %main (a: f32[32,64,1], b: f32[64,2,16]) -> f32[32,2,16] {
  %a = f32[32,64,1]{1,0,2} parameter(0)
  %b = f32[64,2,16]{0,2,1} parameter(1)
  ROOT %c = f32[32,2,16]{0,2,1} convolution(%a, %b), window={size=2 pad=1_1 rhs_reversal=1}, dim_labels=bf0_i0o->b0f
}
"""
  assert hlo_flops.matmul_flops(text)["flops"] == 2 * 32 * 2 * 16 * 64
