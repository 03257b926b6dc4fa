"""The vocabulary-chunk engine: does a chunked KD step use two cores, and what does a chunk hold
per device under data parallelism?

  python benchmarks/vocab_chunks.py [--quick]

Time: the LogitKD loss + gradient (student and teacher forwards included, as
`make_distill_objective` compiles it) at vocabulary 128,256 and 4 x 256 tokens on one CPU device,
chunked (auto) and unchunked, each in a child process pinned with `taskset` to one core and then
to two. The speed-up is the one-core time over the two-core time (median of the repetitions).
Memory: XLA's compiled temporaries per device of the whole train step (`build_engine`, jit)
under `dp` on 8 simulated devices at 8 x 256 tokens, chunked (auto).

The script measures the checkout it sits in: to compare with an older commit, copy
`benchmarks/` into a `git worktree` of that commit and run it there too.
--quick: 2 repetitions and a 32k vocabulary. Writes benchmarks/results/vocab_chunks.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a question about CPU cores (libtpu may be installed)
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.lib import common, subproc  # noqa: E402
from distillax import partitioning as pt  # noqa: E402
from distillax.distill import LogitKD, make_distill_objective  # noqa: E402
from distillax.framework.engine import build_engine  # noqa: E402
from distillax.framework.optim import default_optimizer_config  # noqa: E402
from distillax.models.config import TransformerConfig  # noqa: E402
from distillax.models.transformer import Transformer  # noqa: E402

VOCAB, QUICK_VOCAB, LENGTH = 128_256, 32_000, 256
TIME_BATCH, MEMORY_BATCH, MEMORY_DEVICES = 4, 8, 8
SYSTEMS = {"chunked": -1, "unchunked": None}  # distill chunk_size: auto, whole logits


def _models(vocab: int, batch: int):
  """A model maker (1 layer: the logits dominate) and a batch."""
  small = dict(vocab_size=vocab, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32,
               mlp_dim=128, max_seq_len=LENGTH)
  make = lambda width, seed: Transformer(TransformerConfig(embed_dim=width, **small),
                                         rngs=nnx.Rngs(seed))
  rng = jax.random.key(0)
  tokens = jax.random.randint(rng, (batch, LENGTH), 0, vocab, jnp.int32)
  batch = {"inputs_BxL": tokens, "targets_BxL": jnp.roll(tokens, -1, axis=1),
           "loss_mask_BxL": jnp.ones((batch, LENGTH), jnp.float32)}
  return make, batch


def child_time(vocab: int, chunk, reps: int) -> dict:
  make, batch = _models(vocab, TIME_BATCH)
  student, teacher = make(64, 0), make(128, 1)
  objective = make_distill_objective(LogitKD(), chunk_size=chunk, metrics=False)
  graph, params = nnx.split(student)

  def loss(params, teacher, batch):
    out = objective(nnx.merge(graph, params), {"teacher": teacher}, batch, None)
    return out.loss_sum / out.tokens

  step = jax.jit(jax.value_and_grad(loss))
  jax.block_until_ready(step(params, teacher, batch))  # compile
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(step(params, teacher, batch))
    times.append(time.perf_counter() - start)
  return {"step_s": common.median(times), "step_s_all": times,
          "cores": len(os.sched_getaffinity(0))}


def child_memory(vocab: int, chunk) -> dict:
  make, _ = _models(vocab, MEMORY_BATCH)
  mesh = pt.create_mesh({"data": MEMORY_DEVICES, "model": 1})
  with jax.set_mesh(mesh):
    student = nnx.eval_shape(lambda: make(64, 0))
    teacher = nnx.eval_shape(lambda: make(128, 1))
  shapes = {k: jax.ShapeDtypeStruct((MEMORY_BATCH, LENGTH), dt) for k, dt in
            (("inputs_BxL", jnp.int32), ("targets_BxL", jnp.int32),
             ("loss_mask_BxL", jnp.float32))}
  objective = make_distill_objective(LogitKD(), chunk_size=chunk, metrics=False)
  engine = build_engine(student, {"teacher": teacher}, objective, default_optimizer_config(),
                        100, mesh, pt.rules_from_config({"strategy": "dp"}), "jit", shapes)
  return {"temp_bytes_per_device": int(engine.runner.stats["temp_size_in_bytes"])}


def run_child(args, *, mode: str, system: str, cores: str | None) -> dict:
  """One measurement in its own process (`taskset -c cores` when given)."""
  Path(args.out).mkdir(parents=True, exist_ok=True)
  out = Path(args.out) / f".vocab_chunks_{os.getpid()}.json"
  cmd = [sys.executable, __file__, "--child", mode, "--system", system, "--vocab",
         str(args.vocab), "--reps", str(args.reps), "--child-out", str(out),
         "--devices", str(MEMORY_DEVICES if mode == "memory" else 1)]
  if cores is not None:
    cmd = ["taskset", "-c", cores] + cmd
  subprocess.run(cmd, check=True)
  result = json.loads(out.read_text())
  out.unlink()
  return result


def measure(args) -> list[dict]:
  rows = []
  for system in SYSTEMS:
    one = run_child(args, mode="time", system=system, cores="0")
    two = run_child(args, mode="time", system=system, cores="0,1")
    row = {"system": system, "vocab": args.vocab, "tokens": TIME_BATCH * LENGTH,
           "one_core_s": one["step_s"], "two_core_s": two["step_s"],
           "speedup": one["step_s"] / two["step_s"], "one_core_all": one["step_s_all"],
           "two_core_all": two["step_s_all"]}
    if system == "chunked":
      row.update(run_child(args, mode="memory", system=system, cores=None))
    rows.append(row)
    print(f"  {system}: 1 core {common.fmt_ms(row['one_core_s'])}, 2 cores "
          f"{common.fmt_ms(row['two_core_s'])}", flush=True)
  return rows


def main(argv=None) -> int:
  parser = subproc.base_parser(__doc__.splitlines()[0])
  parser.add_argument("--reps", type=subproc.positive_int, default=5)
  parser.add_argument("--vocab", type=subproc.positive_int, default=VOCAB)
  parser.add_argument("--child", choices=("time", "memory"), default=None)
  parser.add_argument("--system", choices=tuple(SYSTEMS), default="chunked")
  args = subproc.parse_args(parser, argv)
  if args.child:
    chunk = SYSTEMS[args.system]
    result = (child_time(args.vocab, chunk, args.reps) if args.child == "time"
              else child_memory(args.vocab, chunk))
    subproc.write_child_result(args.child_out, result)
    return 0
  if shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2:
    print("vocab_chunks: needs taskset and at least 2 cores", file=sys.stderr)
    return 2
  if args.quick:
    args.reps, args.vocab = 2, QUICK_VOCAB
  rows = measure(args)
  print(common.format_table(rows, [
      ("system", lambda r: r["system"]),
      ("1 core", lambda r: common.fmt_ms(r["one_core_s"])),
      ("2 cores", lambda r: common.fmt_ms(r["two_core_s"])),
      ("speed-up", lambda r: common.fmt_ratio(r["speedup"])),
      ("temp/device dp8", lambda r: common.fmt_bytes(r.get("temp_bytes_per_device")))]))
  path = common.write_json(args.out, "vocab_chunks", {
      "settings": {"vocab": args.vocab, "reps": args.reps, "length": LENGTH,
                   "time_batch": TIME_BATCH, "memory_batch": MEMORY_BATCH,
                   "memory_devices": MEMORY_DEVICES},
      "machine": common.machine_info(), "rows": rows})
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
