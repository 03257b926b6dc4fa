"""Where could QAT's q8_0 activation rounding go faster? Formulations timed on the chip.

  python benchmarks/q8_0_activation.py [--quick] [--out DIR]

q4_0 QAT KD spends 135 ms of its 758 ms step rounding matmul inputs to q8_0 blocks (the call-4
profile: half in the forward, half in remat's recompute). This times, on arrays of the real
student's matmul-input widths (8,192 tokens x 1,024 / 2,048 / 3,072), the rounding as
quant/ggml.fake_quantize_activation does it (blocks of 32 along the minor axis, every
elementwise step in that layout) against formulations that keep the elementwise steps in the
array's own layout: the block maxima by a reshape (in f32 or in the input's bf16, exact either
way), broadcast back by jnp.repeat or by a one-hot f32 matmul (exact at HIGHEST: one nonzero
term a column), and a transposed layout with the blocks along sublanes. Every variant is checked
for the same values as the current one (bitwise too: the current one writes +0 where a
variant may write -0, which no matmul tells apart), and timed against a read-and-write of the
array (`floor_x2`). On a CPU, --quick checks the values at a tiny size.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.lib import subproc  # noqa: E402
from distillax.quant import ggml  # noqa: E402

f32 = jnp.float32


def parts(amax):
  d = amax / f32(127)
  mult = jnp.where(amax == 0, f32(0), f32(127) / jnp.where(amax == 0, 1, amax))
  return mult, ggml._f16_rounded(d)


def v0(x):
  return ggml.fake_quantize_activation(x, "q8_0", [x.ndim - 1])


def _repeat(v, D):
  return jnp.repeat(v, 32, axis=-1)


def _onehot(v, D):
  nb = D // 32
  E = (jnp.arange(D)[None, :] // 32 == jnp.arange(nb)[:, None]).astype(f32)
  return jnp.dot(v, E, precision=jax.lax.Precision.HIGHEST)


def natural(broadcast, reduce_dtype):
  def f(x):
    T, D = x.shape
    amax = jnp.max(jnp.abs(x.astype(reduce_dtype)).reshape(T, D // 32, 32), axis=-1).astype(f32)
    mult, d = parts(amax)
    xf = x.astype(f32)
    codes = jnp.round(xf * broadcast(mult, D))
    return (broadcast(d, D) * codes).astype(x.dtype)
  return f


def transposed(x):
  T, D = x.shape
  xt = x.T.reshape(D // 32, 32, T)
  amax = jnp.max(jnp.abs(xt), axis=1, keepdims=True).astype(f32)
  mult, d = parts(amax)
  out = d * jnp.round(xt.astype(f32) * mult)
  return out.reshape(D, T).T.astype(x.dtype)


def floor(x):
  return x * 2


# The current formulation first: every other is compared with it.
VARIANTS = {"v0_current": v0, "floor_x2": floor,
            "repeat_f32": natural(_repeat, f32), "repeat_bf16max": natural(_repeat, jnp.bfloat16),
            "onehot_f32": natural(_onehot, f32), "onehot_bf16max": natural(_onehot, jnp.bfloat16),
            "transposed": transposed}


def timed(fn, x, reps):
  jax.block_until_ready(fn(x))
  ts = []
  for _ in range(reps):
    s = time.perf_counter()
    jax.block_until_ready(fn(x))
    ts.append(time.perf_counter() - s)
  return float(np.median(ts))


def measure(shape, reps: int) -> list[dict]:
  x = (jax.random.normal(jax.random.key(0), shape, f32) * 3).astype(jnp.bfloat16)
  x = x.at[0, :32].set(0)  # a block of zeros: its scale and multiplier are 0
  want, rows = None, []
  for name, fn in VARIANTS.items():
    jf = jax.jit(fn)
    got = np.asarray(jf(x))
    seconds = timed(jf, x, reps)
    want = got if want is None else want
    row = {"shape": list(shape), "variant": name, "ms": seconds * 1e3,
           "gb_per_s": 2 * x.size * x.dtype.itemsize / seconds / 1e9}
    if name != "floor_x2":
      row["value_equal"] = bool(np.array_equal(got, want))
      row["bitwise_equal"] = bool(np.array_equal(got.view(np.uint16), want.view(np.uint16)))
    print(json.dumps(row), flush=True)
    rows.append(row)
  return rows


def main(argv=None) -> int:
  args = subproc.parse_args(subproc.base_parser(__doc__.splitlines()[0]), argv)
  shapes = [(256, 128)] if args.quick else [(8192, 1024), (8192, 2048), (8192, 3072)]
  rows = [row for shape in shapes for row in measure(shape, 3 if args.quick else 30)]
  out = Path(args.out) / "q8_0_activation.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"backend": jax.default_backend(),
                             "device_kind": jax.devices()[0].device_kind, "rows": rows},
                            indent=1) + "\n")
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
