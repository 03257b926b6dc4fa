"""Logit KD at real vocabularies: step time, compiled memory and the largest batch in 8 GiB.

  python benchmarks/kd_vocab.py [--quick] [--vocabs 256,32000,128256] [--reps N]
  # the same run with Tunix alongside (a scratch venv; never a distillax dependency):
  python3.11 -m venv /tmp/tunix_venv && /tmp/tunix_venv/bin/pip install google-tunix==0.1.7 \\
      jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8 \\
      grain==0.2.18 ml-collections==1.1.0 clu==0.0.12 qwix==0.1.8 tensorboardX==2.6.5
  PYTHONPATH=. /tmp/tunix_venv/bin/python benchmarks/kd_vocab.py

One CPU device, fp32, the demo model bodies (presets demo_student / demo_teacher) with the
vocabulary replaced, LogitKD T=2 alpha=0.7, tokens 4 x 256, the benchmark AdamW (clipping,
masked decay, warmup-cosine; `common.benchmark_optimizer`). distillax runs three ways, all with
the train objective the recipe builds (loss terms and hard_ce; the extra logit metrics are
eval-only): `unchunked` (chunk_size None: [B, L, V] logits), `chunk256` (256 tokens per chunk,
the setting of issue 17's table) and `default` (the config's distill.chunk_size, auto: chunks
sized from the vocabulary and the batch). When `tunix` imports, Tunix 0.1.7's
DistillationTrainer with its LogitStrategy runs the same shapes (benchmarks/lib/tunix_kd.py):
its llama3 model built from the same configs (layers, widths, heads, tied embeddings; Tunix's
own initialisation, which leaves MLP kernels at zero and ignores rope_theta: step cost depends
on shapes only), one-hot labels as its LogitStrategy takes them, a causal mask, and the same
optax transformation. A Tunix step is what its train loop does per step: the teacher's jitted
forward (`_prepare_inputs`), then the jitted train step.

Per vocabulary, every system's step is timed in interleaved rounds (A, B, C, D, A, ...: the
shared machine's slow moments land on all alike); ratios are medians of per-round ratios, and
the load average is recorded next to the figures. Memory is XLA's figure for the compiled
program(s): arguments + temporaries + outputs - aliased (donated) bytes; for Tunix the larger of
its two programs plus what stays resident meanwhile (the teacher's weights during the train
step, the student's state during the teacher's forward). The largest batch (sequences of
`seq_len` tokens) whose peak fits the memory limit is found compile-only, by bisection guided
by linear interpolation of the peaks found so far. The three distillax runs start from the same
weights and batch: their first losses must agree to 1e-6 relative (checked).

--quick (the smoke test): tiny bodies, vocabulary 1024, 2 x 256 tokens, and the largest batch
(of at most 4, in 16 MiB) for the default variant only.
Writes benchmarks/results/kd_vocab.json.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import jax  # noqa: E402

from benchmarks.lib import common, subproc  # noqa: E402
from distillax import partitioning as pt  # noqa: E402
from distillax.configs.sections import distill_section  # noqa: E402
from distillax.distill import LogitKD, make_distill_objective  # noqa: E402
from distillax.framework import build_engine  # noqa: E402
from distillax.framework.vocab_chunks import chunk_len, chunk_size_from_config  # noqa: E402
from distillax.models import abstract_model, get_preset  # noqa: E402

TEMPERATURE, ALPHA = 2.0, 0.7
VOCABS = (256, 32_000, 128_256)
TARGET_VOCAB = 128_256  # the issue's done-when: distillax default vs Tunix at Llama 3's vocab
TARGETS = {"tokens_per_s": 1.5, "peak": 0.5, "max_batch": 2.0}


def settings(quick: bool) -> dict:
  if quick:  # tiny bodies; 512 tokens, so chunk256 really runs two chunks
    return {"vocabs": (1024,), "batch": 2, "seq_len": 256, "reps": 2,
            "memory_limit": 16 * 2**20, "max_batch_cap": 4, "models": "tiny",
            "max_batch_systems": ("default",)}
  return {"vocabs": VOCABS, "batch": 4, "seq_len": 256, "reps": 5,
          "memory_limit": 8 * 2**30, "max_batch_cap": 4096, "models": "demo",
          "max_batch_systems": ("unchunked", "chunk256", "default", "tunix")}


def model_configs(vocab: int, s: dict):
  """(student, teacher) configs: the demo bodies, or for --quick the tiny preset's widths (one
  student layer, two teacher layers), with tied embeddings like the demo's, at `vocab`."""
  if s["models"] == "tiny":
    tiny = get_preset("tiny", vocab_size=vocab, tie_embeddings=True, max_seq_len=s["seq_len"],
                      num_layers=1)
    return tiny, tiny.replace(num_layers=2)
  return (get_preset("demo_student").replace(vocab_size=vocab),
          get_preset("demo_teacher").replace(vocab_size=vocab))


def largest_batch(peak_of, limit: int, first: int, cap: int, known=None):
  """(largest b <= cap with peak_of(b) <= limit, {b: peak}), peak non-decreasing in b.

  Keeps lo (fits) and hi (does not) and guesses between them by linear interpolation of the
  two nearest peaks (doubling while nothing failed yet), so a peak affine in b takes a few
  compiles."""
  peaks = dict(known or {})
  lo, hi, b = 0, None, first
  while True:
    if b not in peaks:
      peaks[b] = int(peak_of(b))
    if peaks[b] <= limit:
      lo = max(lo, b)
    else:
      hi = b if hi is None else min(hi, b)
    if (hi is not None and hi - lo <= 1) or (hi is None and lo >= cap) or (hi == 1 and lo == 0):
      return lo, peaks
    b = _next_guess(lo, hi, peaks, limit, cap)


def _next_guess(lo: int, hi: int | None, peaks: dict, limit: int, cap: int) -> int:
  upper = cap if hi is None else hi - 1
  points = sorted(peaks.items())
  below = [p for p in points if p[1] <= limit]
  above = [p for p in points if p[1] > limit]
  pair = (below[-2:] if not above else [below[-1], above[0]]) if below else above[:2]
  guess = 2 * max(lo, 1) if hi is None else (lo + hi) // 2
  if len(pair) == 2 and pair[1][1] != pair[0][1]:
    (b1, p1), (b2, p2) = pair
    guess = int(b1 + (limit - p1) * (b2 - b1) / (p2 - p1))
  return max(lo + 1, min(guess, upper))


# ---- distillax ----------------------------------------------------------------------------------

def distillax_variants() -> dict:
  """name -> chunk_size; `default` is what the config section gives (auto)."""
  return {"unchunked": None, "chunk256": 256,
          "default": chunk_size_from_config(distill_section().chunk_size)}


def distillax_engine(student_cfg, teacher_cfg, chunk_size, batch: int, seq_len: int):
  """The train step the distill recipe compiles (train objective: metrics=False)."""
  objective = make_distill_objective(LogitKD(temperature=TEMPERATURE, alpha=ALPHA),
                                     chunk_size=chunk_size, metrics=False)
  mesh = pt.create_mesh({"data": 1, "model": 1}, devices=jax.devices()[:1])
  rules = pt.rules_from_config({"strategy": "fsdp"})
  return build_engine(abstract_model(student_cfg), {"teacher": abstract_model(teacher_cfg)},
                      objective, common.benchmark_optimizer(), 1000, mesh, rules, "jit",
                      common.batch_shapes(batch, seq_len))


class DistillaxSystem:
  """One distillax variant: a stepper on the benchmark batch and compile-only peaks."""

  def __init__(self, name, chunk_size, student_cfg, teacher_cfg, s, batch, models):
    self.name, self.chunk_size = name, chunk_size
    self.cfgs, self.seq_len = (student_cfg, teacher_cfg), s["seq_len"]
    start = time.perf_counter()
    engine = distillax_engine(student_cfg, teacher_cfg, chunk_size, s["batch"], s["seq_len"])
    self.compile_s = time.perf_counter() - start
    self.stats = dict(engine.runner.stats)
    self.stepper = common.Stepper(engine, models[0], batch, extras={"teacher": models[1]})

  def __call__(self, steps: int) -> None:
    self.stepper(steps)

  @property
  def losses(self):
    return self.stepper.losses

  def peak_at(self, batch: int) -> int:
    return common.peak_bytes(
        distillax_engine(*self.cfgs, self.chunk_size, batch, self.seq_len).runner.stats)


# ---- Tunix (optional) ---------------------------------------------------------------------------

def tunix_kd():
  """benchmarks/lib/tunix_kd.py, or None where Tunix is not installed. Imported here, not at
  the top: Tunix is optional (a scratch venv, never a distillax dependency)."""
  try:
    from benchmarks.lib import tunix_kd as module
  except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] != "tunix":
      raise
    return None
  return module


# ---- one vocabulary -----------------------------------------------------------------------------

def build_systems(vocab: int, s: dict, with_tunix: bool):
  student_cfg, teacher_cfg = model_configs(vocab, s)
  batch = common.packed_batch(s["batch"], s["seq_len"], vocab, seed=0)
  models = (common.host_model(student_cfg, 0), common.host_model(teacher_cfg, 1))
  systems = {name: DistillaxSystem(name, chunk, student_cfg, teacher_cfg, s, batch, models)
             for name, chunk in distillax_variants().items()}
  if with_tunix:
    systems["tunix"] = tunix_kd().TunixSystem(student_cfg, teacher_cfg, batch,
                                              temperature=TEMPERATURE, alpha=ALPHA)
  for name, system in systems.items():
    print(f"  vocab {vocab}: {name} compiled in {system.compile_s:.0f}s", flush=True)
  return systems, (student_cfg, teacher_cfg)


def timed(systems: dict, reps: int):
  """(wall seconds per step, process CPU seconds per step) of each system, interleaved."""
  cpu = {name: [] for name in systems}

  def with_cpu(name, run):
    def call(steps):
      start = time.process_time()
      run(steps)
      cpu[name].append((time.process_time() - start) / steps)
    return call

  runs = {name: with_cpu(name, system) for name, system in systems.items()}
  times, _ = common.interleaved(runs, reps=reps, steps_per_rep=1, warmup_steps=1)
  return times, {name: c[1:] for name, c in cpu.items()}  # drop the warm-up's


def chunk_tokens(chunk_size, batch: int, length: int, vocab: int) -> int | None:
  """Tokens per logit chunk the objective uses on one device (auto resolved as the engine
  resolves it, without rules); None: unchunked."""
  return None if chunk_size is None else batch * chunk_len(chunk_size, batch, length, vocab)


def measure_vocab(vocab: int, s: dict, with_tunix: bool) -> list[dict]:
  systems, cfgs = build_systems(vocab, s, with_tunix)
  load_before = os.getloadavg()
  times, cpu = timed(systems, s["reps"])
  load_after = os.getloadavg()
  tokens = s["batch"] * s["seq_len"]
  rows = []
  for name, system in systems.items():
    stats = system.stats
    peak = stats["peak"] if name == "tunix" else common.peak_bytes(stats)
    best, peaks = None, {s["batch"]: peak}
    if s["max_batch"] and name in s["max_batch_systems"]:
      print(f"  vocab {vocab}: {name}: largest batch in "
            f"{common.fmt_bytes(s['memory_limit'])}...", flush=True)
      best, peaks = largest_batch(system.peak_at, s["memory_limit"], s["batch"],
                                  s["max_batch_cap"], known=peaks)
    step_s = common.median(times[name])
    rows.append({
        "vocab": vocab, "system": name, "chunk_size": getattr(system, "chunk_size", None),
        "chunk_tokens": chunk_tokens(getattr(system, "chunk_size", None), s["batch"],
                                     s["seq_len"], vocab),
        "tokens": tokens, "step_s": step_s, "step_s_all": times[name],
        "cpu_s": common.median(cpu[name]), "cpu_s_all": cpu[name],
        "tokens_per_s": tokens / step_s, "peak_bytes": peak,
        "temp_bytes": int(stats["temp_size_in_bytes"]), "flops": stats.get("flops"),
        "max_batch": best, "peaks_by_batch": {str(b): p for b, p in sorted(peaks.items())},
        "first_loss": system.losses[0], "final_loss": system.losses[-1],
        "compile_s": system.compile_s, "load_avg_before": load_before,
        "load_avg_after": load_after, "student": common.config_summary(cfgs[0])
        | {"tie_embeddings": cfgs[0].tie_embeddings}, "teacher": common.config_summary(cfgs[1])
        | {"tie_embeddings": cfgs[1].tie_embeddings}})
  for r in rows:
    for ref in ("unchunked", "tunix"):
      if ref in times:
        r[f"time_ratio_to_{ref}"] = common.paired_ratio(times, r["system"], ref)
  return rows


# ---- report -------------------------------------------------------------------------------------

def checks(rows: list[dict], with_tunix: bool) -> list[dict]:
  """Same first loss across the distillax runs; the issue's targets where Tunix ran."""
  out = []
  for vocab in sorted({r["vocab"] for r in rows}):
    mine = [r for r in rows if r["vocab"] == vocab and r["system"] != "tunix"]
    ref = mine[0]["first_loss"]
    diff = max(abs(r["first_loss"] - ref) / abs(ref) for r in mine)
    out.append({"check": f"vocab {vocab}: same first loss unchunked/chunked/default",
                "value": diff, "target": 1e-6, "pass": diff <= 1e-6, "required": True})
  by = {(r["vocab"], r["system"]): r for r in rows}
  if with_tunix and (TARGET_VOCAB, "tunix") in by:
    d, t = by[(TARGET_VOCAB, "default")], by[(TARGET_VOCAB, "tunix")]
    speed = 1.0 / d["time_ratio_to_tunix"]
    out += [
        {"check": "vocab 128256: default tokens/s over Tunix's", "value": speed,
         "target": TARGETS["tokens_per_s"], "pass": speed >= TARGETS["tokens_per_s"]},
        {"check": "vocab 128256: default peak memory over Tunix's",
         "value": d["peak_bytes"] / t["peak_bytes"], "target": TARGETS["peak"],
         "pass": d["peak_bytes"] <= TARGETS["peak"] * t["peak_bytes"]},
    ]
    if d["max_batch"] is not None and t["max_batch"] is not None:
      out.append({"check": "vocab 128256: default max batch over Tunix's",
                  "value": d["max_batch"] / max(t["max_batch"], 1),
                  "target": TARGETS["max_batch"],
                  "pass": d["max_batch"] >= TARGETS["max_batch"] * t["max_batch"]})
  return out


def print_table(rows: list[dict], s: dict) -> None:
  print(common.format_table(rows, [
      ("vocab", lambda r: r["vocab"]), ("system", lambda r: r["system"]),
      ("chunk", lambda r: "-" if r["chunk_tokens"] is None else r["chunk_tokens"]),
      ("step ms", lambda r: common.fmt_ms(r["step_s"])),
      ("cpu ms", lambda r: common.fmt_ms(r["cpu_s"])),
      ("tokens/s", lambda r: f"{r['tokens_per_s']:.0f}"),
      ("time vs Tunix", lambda r: common.fmt_ratio(r.get("time_ratio_to_tunix"))),
      ("peak", lambda r: common.fmt_bytes(r["peak_bytes"])),
      (f"max batch ({common.fmt_bytes(s['memory_limit'])})",
       lambda r: "-" if r["max_batch"] is None else r["max_batch"]),
      ("load", lambda r: f"{r['load_avg_before'][0]:.1f}"),
  ]))


def main() -> int:
  parser = subproc.base_parser(__doc__.splitlines()[0])
  parser.add_argument("--vocabs", default="", help="comma-separated vocabulary sizes")
  parser.add_argument("--reps", type=int, default=0, help="timed rounds per vocabulary")
  parser.add_argument("--no-tunix", action="store_true", help="skip Tunix even if it imports")
  parser.add_argument("--no-max-batch", action="store_true",
                      help="skip the compile-only search for the largest batch")
  args = subproc.parse_args(parser)

  s = settings(args.quick)
  if args.vocabs:
    s["vocabs"] = tuple(int(v) for v in args.vocabs.split(","))
  s["reps"] = args.reps or s["reps"]
  s["max_batch"] = not args.no_max_batch
  with_tunix = not args.no_tunix and tunix_kd() is not None
  print(f"Tunix: {'yes' if with_tunix else 'not importable or skipped'}; load average "
        f"{os.getloadavg()}", flush=True)
  rows = []
  for vocab in s["vocabs"]:
    rows += measure_vocab(vocab, s, with_tunix)
  bodies = "tiny" if s["models"] == "tiny" else "demo_student <- demo_teacher"
  print(f"\n{bodies}, {s['batch']} x {s['seq_len']} tokens, LogitKD "
        f"T={TEMPERATURE} alpha={ALPHA}, fp32, one {common.machine_info()['platform']} device")
  print_table(rows, s)
  results = checks(rows, with_tunix)
  for c in results:
    print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['check']}: {c['value']:.3g} "
          f"(target {c['target']})")
  path = common.write_json(args.out, "kd_vocab", {
      "machine": common.machine_info(), "quick": args.quick, "settings": s,
      "tunix": with_tunix, "rows": rows, "checks": results})
  print(f"\nwrote {path}")
  return 0 if all(c["pass"] for c in results if c.get("required")) else 1


if __name__ == "__main__":
  sys.exit(main())
