"""Which splash attention tiles are fastest on this chip, for head dims 64 and 128?

  python benchmarks/splash_blocks.py [--quick] [--out DIR]

Splash attention (Pallas, TPU) runs forward and backward in tiles of `block_q` queries by
`block_kv` keys (computed `block_kv_compute` at a time), and its backward pass is either two
kernels (dq, then dk/dv) or one fused kernel. The best tiles depend on the chip and the head
dim, so they are measured: the forward and backward of distillax's own `splash_attention` (the
per-device layout the model uses: one MQA kernel per batch row and kv head) for each setting,
the shapes of the benchmark pairs' attention (16 query heads on 8 kv heads at head dim 128, the
Qwen3 pair; 16 on 8 at 64, the continuity pair), sequence 2048 and 8192, compiled in parallel
threads and timed apart; every setting's output and gradients are checked against the first
(the shipped tiles) to 1e-2 (bf16).

Writes splash_blocks.json. --quick: one small shape in Pallas interpret mode (CPU), a check of
the script itself.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.lib import common, subproc  # noqa: E402
from distillax.models.attention.fused import splash_attention  # noqa: E402

# (block_q, block_kv, block_kv_compute, fused backward); the first is what shipped before these
# figures (512 tiles, two backward kernels), the reference every other setting is checked against.
SETTINGS = ((512, 512, 512, False), (512, 512, 512, True), (512, 1024, 512, True),
            (1024, 1024, 512, True), (1024, 1024, 1024, True), (256, 1024, 512, True),
            (512, 2048, 512, True), (2048, 2048, 512, True))
SHAPES = ((4, 2048, 8, 2, 128), (4, 2048, 8, 2, 64), (1, 8192, 8, 2, 128))  # B, L, K, G, H
SHAPES_BY_NAME = {"2k128": SHAPES[0], "2k64": SHAPES[1], "8k128": SHAPES[2]}
QUICK_SHAPES = ((1, 256, 1, 2, 64),)
QUICK_SETTINGS = ((128, 128, 128, False), (128, 256, 128, True))


def _inputs(B, L, K, G, H, dtype):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (B, L, K, G, H), dtype)
  k = jax.random.normal(keys[1], (B, L, K, H), dtype)
  v = jax.random.normal(keys[2], (B, L, K, H), dtype)
  seg = jnp.ones((B, L), jnp.int32).at[:, L // 2:].set(2)  # two packed documents per row
  return q, k, v, seg, jax.random.normal(keys[3], (B, L, K, G, H), dtype)


def _fwd_bwd(setting, scale, interpret):
  blocks, fused = setting[:3], setting[3]

  def loss(q, k, v, seg, ct):
    out = splash_attention(q, k, v, q_segment_BxL=seg, k_segment_BxS=seg, scale=scale,
                           interpret=interpret, blocks=blocks, fused_bwd=fused)
    return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)

  def run(*args):
    (value, out), grads = grad(*args)
    return value, grads, out
  return jax.jit(run)


def measure_shape(shape, settings, interpret: bool, reps: int, threads: int) -> list[dict]:
  B, L, K, G, H = shape
  dtype = jnp.float32 if interpret else jnp.bfloat16
  args = _inputs(B, L, K, G, H, dtype)
  lowered = [(s, _fwd_bwd(s, H ** -0.5, interpret).lower(*args)) for s in settings]
  with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
    futures = [(s, pool.submit(lambda low: low.compile(), low)) for s, low in lowered]
  compiled, rows = {}, []
  for s, fut in futures:
    try:
      compiled[s] = fut.result()
    except Exception as e:  # noqa: BLE001 - a tile too big for VMEM is a row
      rows.append({"shape": shape, "setting": s, "status": "error", "error": str(e)[:400]})
  ok = {s: (exe, args) for s, exe in compiled.items()}
  if not ok:
    return rows
  table, times, results = common.compiled_side_by_side(ok, reps=reps)
  ref = settings[0] if settings[0] in results else next(iter(results))
  flops = 4 * B * K * G * H * L * L / 2 * 3.5  # causal fwd (2 matmuls) + bwd (5 matmuls)
  for s, row in table.items():
    _, grads, out = results[s]
    _, grads_ref, out_ref = results[ref]
    gap = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
              for a, b in zip((out, *grads), (out_ref, *grads_ref)))
    rows.append({"shape": {"B": B, "L": L, "kv_heads": K, "groups": G, "head_dim": H},
                 "setting": {"block_q": s[0], "block_kv": s[1], "block_kv_compute": s[2],
                             "fused_bwd": s[3]}, "status": "ok", "step_s": row["step_s"],
                 "step_s_all": row["step_s_all"], "tflops_per_s": flops / row["step_s"] / 1e12,
                 "max_gap_vs_first": gap, "agrees": gap < 1e-2 * max(
                     1.0, float(jnp.max(jnp.abs(out_ref.astype(jnp.float32)))))})
  return rows


def main(argv=None) -> int:
  parser = subproc.base_parser(__doc__.splitlines()[0])
  parser.add_argument("--threads", type=int, default=8)
  parser.add_argument("--shapes", default=",".join(SHAPES_BY_NAME),
                      help=f"comma-separated of {', '.join(SHAPES_BY_NAME)}")
  parser.add_argument("--reps", type=int, default=5)
  args = parser.parse_args(argv)
  interpret = jax.default_backend() != "tpu"
  shapes, settings = (QUICK_SHAPES, QUICK_SETTINGS) if args.quick or interpret else (
      tuple(SHAPES_BY_NAME[n] for n in args.shapes.split(",")), SETTINGS)
  rows = []
  for shape in shapes:
    t0 = time.perf_counter()
    rows += measure_shape(shape, settings, interpret, reps=2 if args.quick else args.reps,
                          threads=args.threads)
    print(f"{shape}: {time.perf_counter() - t0:.0f}s", flush=True)
  best = {}
  for r in rows:
    if r["status"] == "ok" and r["agrees"]:
      key = json.dumps(r["shape"], sort_keys=True)
      if key not in best or r["step_s"] < best[key]["step_s"]:
        best[key] = r
  print(common.format_table(rows, [
      ("shape", lambda r: "x".join(str(v) for v in (r["shape"].values() if isinstance(
          r["shape"], dict) else r["shape"]))),
      ("q/kv/kvc", lambda r: "/".join(str(r["setting"][k]) for k in (
          "block_q", "block_kv", "block_kv_compute")) if r["status"] == "ok" else r["setting"]),
      ("fused bwd", lambda r: r["setting"]["fused_bwd"] if r["status"] == "ok" else ""),
      ("fwd+bwd ms", lambda r: common.fmt_ms(r.get("step_s"))),
      ("TFLOP/s", lambda r: f"{r['tflops_per_s']:.0f}" if r["status"] == "ok" else r["error"][:60]),
      ("agrees", lambda r: r.get("agrees", ""))]))
  common.write_json(args.out, "splash_blocks", {
      "device_kind": jax.devices()[0].device_kind, "interpret": interpret, "rows": rows,
      "best": list(best.values())})
  return 0


if __name__ == "__main__":
  sys.exit(main())
