"""Chunked vs unchunked LogitKD: peak temporary memory and time of loss + gradient.

  python benchmarks/kd_loss.py [--quick]

The objective is the one the trainer compiles (`make_distill_objective(LogitKD(...))`, student and
teacher forward passes included), differentiated with respect to the student's parameters, on one
CPU device at vocabularies of 32k and 256k and B x L = 2 x 256 tokens. Both models have a small
trunk (1 layer, width 64 and 128), so the [tokens, vocab] logits dominate as they do in LLM
distillation. Unchunked, the full fp32 logits of both models (and their softmaxes and gradient)
exist at once; chunked, `chunk_size` tokens at a time. Memory is XLA's own figure for the
compiled executable (`memory_analysis().temp_size_in_bytes`); time is the median over interleaved
repetitions. Both paths must give the same loss (checked, rel 1e-5), and at 256k the chunked path
must use at most a quarter of the unchunked temporary memory (PASS/FAIL).

--quick: the 32k timings with fewer repetitions; at 256k memory only (compile, no run).
Writes benchmarks/results/kd_loss.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.lib import common, subproc  # noqa: E402
from distillax.distill import LogitKD, make_distill_objective  # noqa: E402
from distillax.models import TransformerConfig, create_model  # noqa: E402

B, L = 2, 256
CHUNKS = (None, 128, 64)  # None = unchunked; 64 tokens is the chunk the PASS check uses
CHECKED_CHUNK = 64
MEMORY_TARGET = 0.25


def build(vocab: int, chunk: int | None):
  """(jitted loss+grad fn, its args) for one vocabulary and chunk size."""
  small = dict(vocab_size=vocab, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
               max_seq_len=L)
  student = create_model(TransformerConfig(embed_dim=64, mlp_dim=128, **small), seed=0)
  teacher = create_model(TransformerConfig(embed_dim=128, mlp_dim=256, **small), seed=1)
  objective = make_distill_objective(LogitKD(temperature=2.0, alpha=0.7), chunk_size=chunk)
  graph, params = nnx.split(student)
  batch = {k: jax.numpy.asarray(v) for k, v in common.packed_batch(B, L, vocab, seed=0).items()}

  def loss(params, teacher, batch):
    out = objective(nnx.merge(graph, params), {"teacher": teacher}, batch, None)
    return out.loss_sum / out.tokens

  return jax.jit(jax.value_and_grad(loss)), (params, teacher, batch)


def measure(vocab: int, reps: int, run: bool) -> list[dict]:
  rows, calls = [], {}
  for chunk in CHUNKS:
    fn, args = build(vocab, chunk)
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    rows.append({"vocab": vocab, "chunk_size": chunk, "tokens": B * L,
                 "temp_bytes": int(mem.temp_size_in_bytes),
                 "argument_bytes": int(mem.argument_size_in_bytes),
                 "output_bytes": int(mem.output_size_in_bytes), "compile_s": compile_s})
    if run:
      name = str(chunk)
      result = {}

      def call(steps, compiled=compiled, args=args, result=result):
        for _ in range(steps):
          result["out"] = jax.block_until_ready(compiled(*args))
      calls[name] = (call, result)
  if run:
    times, _ = common.interleaved({k: c for k, (c, _) in calls.items()}, reps=reps,
                                  steps_per_rep=1, warmup_steps=1)
    reference = float(calls["None"][1]["out"][0])
    for row in rows:
      name = str(row["chunk_size"])
      loss = float(calls[name][1]["out"][0])
      row.update(time_s=common.median(times[name]), times_s=times[name], loss=loss,
                 time_ratio_to_unchunked=common.paired_ratio(times, name, "None"),
                 loss_rel_diff=abs(loss - reference) / abs(reference))
  full = rows[0]["temp_bytes"]
  for row in rows:
    row["temp_ratio_to_unchunked"] = row["temp_bytes"] / full
  return rows


def main() -> int:
  args = subproc.parse_args(subproc.base_parser(__doc__.splitlines()[0]))

  reps = 2 if args.quick else 5
  rows = []
  for vocab in (32_768, 262_144):
    run = not (args.quick and vocab > 32_768)
    print(f"vocab {vocab}: compiling{' and timing' if run else ' (memory only)'} ...", flush=True)
    rows += measure(vocab, reps, run)

  def fmt_chunk(r):
    return "unchunked" if r["chunk_size"] is None else str(r["chunk_size"])

  print(f"\nLogitKD loss + grad, B x L = {B} x {L}, one {common.machine_info()['platform']} device")
  print(common.format_table(rows, [
      ("vocab", lambda r: r["vocab"]), ("chunk", fmt_chunk),
      ("temp memory", lambda r: common.fmt_bytes(r["temp_bytes"])),
      ("vs unchunked", lambda r: common.fmt_ratio(r["temp_ratio_to_unchunked"])),
      ("time ms", lambda r: common.fmt_ms(r.get("time_s"))),
      ("time vs unchunked", lambda r: common.fmt_ratio(r.get("time_ratio_to_unchunked"))),
      ("loss rel diff", lambda r: f"{r['loss_rel_diff']:.1e}" if "loss_rel_diff" in r else "n/a"),
  ]))
  checked = next(r for r in rows if r["vocab"] == 262_144 and r["chunk_size"] == CHECKED_CHUNK)
  memory_pass = checked["temp_ratio_to_unchunked"] <= MEMORY_TARGET
  same_loss = all(r.get("loss_rel_diff", 0.0) <= 1e-5 for r in rows)
  print(f"{'PASS' if memory_pass else 'FAIL'}  vocab 256k, chunk {CHECKED_CHUNK}: temporary memory "
        f"{checked['temp_ratio_to_unchunked']:.3f} of unchunked (target <= {MEMORY_TARGET})")
  print(f"{'PASS' if same_loss else 'FAIL'}  chunked and unchunked losses agree (rel <= 1e-5)")
  payload = {"machine": common.machine_info(), "quick": args.quick, "batch": B, "seq_len": L,
             "rows": rows,
             "memory_check": {"vocab": 262_144, "chunk_size": CHECKED_CHUNK,
                              "ratio": checked["temp_ratio_to_unchunked"],
                              "target": MEMORY_TARGET, "pass": memory_pass},
             "loss_check": {"pass": same_loss}}
  path = common.write_json(args.out, "kd_loss", payload)
  print(f"\nwrote {path}")
  return 0 if memory_pass and same_loss else 1


if __name__ == "__main__":
  sys.exit(main())
