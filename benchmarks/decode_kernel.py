"""How close does the decode kernel come to reading its cache at HBM speed, per layout?

  python benchmarks/decode_kernel.py [--rows 32] [--slots 1024] [--filled 768,1024]
      [--variants 'bf16:0:1,int8:0:1,...'] [--json PATH (default
      benchmarks/results/decode_kernel.json)]

The kernel alone (models/attention/decode.stacked_decode_attention), at the real student's
attention shape (Qwen3-0.6B: 28 layers, 8 kv heads of 128, 2 queries a head), as one decode
step of the sampler calls it: once per layer of the stacked cache, every layer in one program.
A variant is `dtype:block:rows_per_step[:schedule]` (0: the kernel's own choice, decode.layout;
`dtype:0:1` is one row a step in the largest block, the kernel's first layout and each dtype's
baseline). The schedule is the kernel's default unless named: `earlier` (each row group's first
block fetched at its start, not under the previous group's last compute); a variant is also set
against its `earlier` twin of the same run. (Call 15's `earlier` and `prefetch` rows also
masked by compares and selects, since replaced by the default's bias masks.) Three ablations of the default find what bounds it
(their outputs are wrong by design): `no-compute` (the blocks fetched, nothing computed: the
schedule's DMA time), `no-qk` (no key products or key converts), `no-pv` (no value products or
value converts).
Each variant's time per step is set against what it reads (the cache blocks up to the filled
slot, keys and values, with an int8 cache's scales) at the chip's HBM bandwidth, and against
its dtype's baseline in the same run. On a CPU it runs in Pallas' interpreter at a tiny size
(as --quick does anywhere), a check of the bookkeeping only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import contextlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.lib import common  # noqa: E402
from distillax.framework import throughput  # noqa: E402
from distillax.models.attention import decode as decode_module  # noqa: E402
from distillax.models.attention.cache_slot import quantize_rows  # noqa: E402
from distillax.models.attention.decode import resolve_layout  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REAL = dict(layers=28, kv_heads=8, groups=2, head_dim=128)
QUICK = dict(layers=2, kv_heads=2, groups=2, head_dim=128)
DEFAULT_VARIANTS = "bf16:0:1,bf16:0:0:earlier,bf16:0:0,int8:0:1,int8:0:0:earlier,int8:0:0"
SCHEDULES = {"": {}, "earlier": dict(prefetch_next_rows=False),
             "no-compute": {}, "no-qk": {}, "no-pv": {}}


def _ablated_row(what: str):
  """decode._attend_row without a part (`what`), for the ablations."""
  def row(r, q_ref, k_ref, v_ref, valid_ref, head_bias_ref, m_ref, l_ref, acc_ref, scale_refs,
          *, scale, softcap):
    if what == "no-compute":
      return
    q = q_ref[r]
    rows = k_ref.shape[2]
    if what == "no-qk":
      scores = jnp.broadcast_to(q[:, :1].astype(jnp.float32), (q.shape[0], rows)) * scale
    else:
      k = k_ref[0, r].astype(q.dtype) if scale_refs else k_ref[0, r]
      scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32) * scale
    scores = scores + head_bias_ref[...] + valid_ref[r]
    m_new = jnp.maximum(m_ref[r], scores.max(axis=1, keepdims=True))
    p = jnp.exp(scores - m_new)
    l_ref[r] = l_ref[r] + p.sum(axis=1, keepdims=True)
    if what == "no-pv":
      acc_ref[r] = acc_ref[r] + p[:, :acc_ref.shape[-1]]
    else:
      v = v_ref[0, r].astype(q.dtype) if scale_refs else v_ref[0, r]
      acc_ref[r] = acc_ref[r] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    m_ref[r] = m_new
  return row


@contextlib.contextmanager
def _kernel_for(schedule: str):
  """The kernel as `schedule` runs it: an ablation swaps the row update while tracing."""
  if schedule not in ("no-compute", "no-qk", "no-pv"):
    yield decode_module.stacked_decode_attention
    return
  saved = decode_module._attend_row
  decode_module._attend_row = _ablated_row(schedule)
  try:
    yield decode_module.stacked_decode_attention.__wrapped__  # traced anew, not from jit's cache
  finally:
    decode_module._attend_row = saved


_CACHES: dict = {}


def caches(shape: dict, rows: int, slots: int, dtype: str, seed: int = 0):
  """_new_caches, the last ones kept for the next variant of the same dtype."""
  key = (tuple(shape.items()), rows, slots, dtype, seed)
  if key not in _CACHES:
    _CACHES.clear()
    _CACHES[key] = _new_caches(shape, rows, slots, dtype, seed)
  return _CACHES[key]


def _new_caches(shape: dict, rows: int, slots: int, dtype: str, seed: int = 0):
  """Random keys and values (and an int8 cache's codes and scales), stacked as the model holds
  them: (layers, rows, slots, kv heads, head dim)."""
  N, K, H = shape["layers"], shape["kv_heads"], shape["head_dim"]
  keys = jax.random.split(jax.random.key(seed), N)
  # Layer by layer, jitted: an int8 cache's float temporaries stay one layer's (48 rows of the
  # real student's cache, quantized whole, did not fit the v5e's 16 GiB).
  @jax.jit
  def layer(key):
    k_key, v_key = jax.random.split(key)
    k = jax.random.normal(k_key, (rows, slots, K, H), jnp.bfloat16)
    v = jax.random.normal(v_key, (rows, slots, K, H), jnp.bfloat16)
    if dtype == "bf16":
      return k, v
    (k8, ks), (v8, vs) = quantize_rows(k), quantize_rows(v)
    return k8, v8, ks.reshape(rows, 1, slots * K), vs.reshape(rows, 1, slots * K)
  parts = [layer(key) for key in keys]
  stacked = [jnp.stack([p[i] for p in parts]) for i in range(len(parts[0]))]
  del parts
  return stacked[0], stacked[1], tuple(stacked[2:])


def step_program(block: int, rows_per_step: int, interpret: bool, layers: int, schedule: str):
  """Every layer's kernel call of one decode step, the outputs summed so nothing is dropped."""
  def run(q, k, v, valid, filled, *scales):
    def body(layer, total):
      with _kernel_for(schedule) as kernel:
        out = kernel(q, k, v, layer, valid, filled, *scales, scale=0.088, interpret=interpret,
                     block=block or None, rows_per_step=rows_per_step, **SCHEDULES[schedule])
      return total + out.sum()
    return jax.lax.fori_loop(0, layers, body, jnp.float32(0))
  return jax.jit(run)


def bytes_read(shape: dict, rows: int, slots: int, filled: int, block: int, dtype: str) -> int:
  """What the kernel fetches: every row's blocks up to the filled slot, keys and values."""
  K, H, N = shape["kv_heads"], shape["head_dim"], shape["layers"]
  read_slots = min(slots, -(-filled // block) * block)
  per_slot = K * H + K * 4 if dtype == "int8" else K * H * 2  # codes and a float32 scale a head
  return 2 * N * rows * read_slots * per_slot


def measure(variant: str, shape: dict, rows: int, slots: int, filled: int, reps: int,
            interpret: bool, bandwidth: float | None) -> dict:
  dtype, block, rows_per_step, schedule = (variant.split(":") + [""])[:4]
  block, rows_per_step = int(block), int(rows_per_step)
  k, v, scales = caches(shape, rows, slots, dtype)
  K, G, H = shape["kv_heads"], shape["groups"], shape["head_dim"]
  q = jax.random.normal(jax.random.key(1), (rows, K, G, H), jnp.bfloat16)
  valid = jnp.broadcast_to(jnp.arange(slots) < filled, (rows, slots))
  block, rows_per_step = resolve_layout(rows, slots, K * H * k.dtype.itemsize, block or None,
                                        rows_per_step or None)
  row = {"variant": variant, "dtype": dtype, "block": block, "rows_per_step": rows_per_step,
         "schedule": schedule or "default", "rows": rows, "slots": slots, "filled": filled}
  try:
    fn = step_program(block, rows_per_step, interpret, shape["layers"], schedule)
    args = (q, k, v, valid, jnp.int32(filled), *scales)
    seconds = common.median_call_seconds(fn, args, reps)
  except Exception as e:  # noqa: BLE001 - a layout the chip refuses (e.g. VMEM) is a result
    return {**row, "status": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}
  read = bytes_read(shape, rows, slots, filled, block, dtype)
  row.update(status="ok", step_ms=seconds * 1e3, bytes_read=read,
             read_gb_per_s=read / seconds / 1e9)
  if bandwidth:
    row["of_hbm"] = read / seconds / bandwidth
  return row


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=32)
  parser.add_argument("--slots", type=int, default=1024)
  parser.add_argument("--filled", default="768,1024")
  parser.add_argument("--variants", default=DEFAULT_VARIANTS)
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--quick", action="store_true", help="a tiny size (the CPU's check)")
  parser.add_argument("--json", default=str(RESULTS / "decode_kernel.json"))
  parser.add_argument("--devices", default=None, help=argparse.SUPPRESS)  # the prologue's
  args = parser.parse_args(argv)
  on_tpu = jax.default_backend() == "tpu"
  shape = REAL if on_tpu and not args.quick else QUICK
  rows, slots = (args.rows, args.slots) if on_tpu and not args.quick else (4, 256)
  bandwidth = throughput.hbm_bandwidth_per_device(jax.devices()[0])[0] if on_tpu else None
  results = []
  for filled in (int(f) for f in args.filled.split(",")):
    filled = min(filled, slots)
    for variant in args.variants.split(","):
      row = measure(variant, shape, rows, slots, filled, 2 if not on_tpu else args.reps,
                    not on_tpu, bandwidth)
      base = next((r for r in results if r["filled"] == filled and r["dtype"] == row["dtype"]
                   and r["variant"].endswith(":0:1") and r["status"] == "ok"), None)
      if base and row["status"] == "ok":
        row["speedup_vs_default"] = base["step_ms"] / row["step_ms"]
      twin = next((r for r in results if r["filled"] == filled and r["status"] == "ok"
                   and r["variant"] == ":".join(variant.split(":")[:3] + ["earlier"])), None)
      if twin and row["status"] == "ok" and twin is not row:
        row["speedup_vs_earlier"] = twin["step_ms"] / row["step_ms"]
      results.append(row)
      print(json.dumps(row), flush=True)
  out = Path(args.json)
  common.write_json(out.parent, out.stem, {"backend": jax.default_backend(), "shape": shape,
                                           "argv": sys.argv[1:], "rows": results})
  return 0


if __name__ == "__main__":
  sys.exit(main())
