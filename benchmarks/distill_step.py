"""Online teacher vs offline teacher cache: the distillation step time, demo_student/demo_teacher.

  python benchmarks/distill_step.py [--quick] [--devices N]

Online: the frozen demo_teacher runs inside the compiled step (LogitKD, top-k = K). Offline: the
step reads the teacher's top-K log-probabilities from a cache written by `write_teacher_cache` for
the same batch (CachedLogitKD): no teacher forward pass and no teacher parameters on the device.
Both steps are built by `build_engine` (the trainer's step), start from the same student weights
and see the same batch, so their losses must agree (checked, rel 1e-4): the two compute the same
thing and differ only in where the teacher's numbers come from. Times are interleaved
repetitions (online, offline, online, ...); the ratio is the median of per-round ratios.

Writes benchmarks/results/distill_step.json.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import jax  # noqa: E402

from benchmarks.lib import common, subproc  # noqa: E402
from distillax import partitioning as pt  # noqa: E402
from distillax.distill import (CachedLogitKD, LogitKD, make_distill_objective,  # noqa: E402
                               read_teacher_cache, write_teacher_cache)
from distillax.framework import build_engine  # noqa: E402
from distillax.models import abstract_model, create_model, get_preset  # noqa: E402

TOP_K, TEMPERATURE = 32, 2.0


def settings(quick: bool) -> dict:
  if quick:
    return {"batch": 8, "seq_len": 64, "reps": 2, "steps_per_rep": 1}
  return {"batch": 16, "seq_len": 128, "reps": 7, "steps_per_rep": 3}


def run(quick: bool) -> dict:
  s = settings(quick)
  B, L = s["batch"], s["seq_len"]
  student_cfg, teacher_cfg = get_preset("demo_student"), get_preset("demo_teacher")
  mesh = pt.create_mesh({"data": jax.device_count(), "model": 1})
  rules = pt.rules_from_config({"strategy": "fsdp"})
  batch = common.packed_batch(B, L, student_cfg.vocab_size, seed=0)
  teacher = create_model(teacher_cfg, mesh=mesh, rules=rules, seed=1)
  with tempfile.TemporaryDirectory() as cache_dir:
    write_teacher_cache(teacher, [batch], cache_dir, top_k=TOP_K, temperature=TEMPERATURE)
    cached_batch = next(iter(read_teacher_cache(cache_dir, batch_size=B)))

  def engine(objective, extras, shapes_of):
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in shapes_of.items()}
    abstract_extras = {k: abstract_model(teacher_cfg) for k in extras}
    return build_engine(abstract_model(student_cfg), abstract_extras, objective,
                        common.benchmark_optimizer(), 1000, mesh, rules, "jit", shapes)

  online = engine(make_distill_objective(LogitKD(temperature=TEMPERATURE, top_k=TOP_K)),
                  {"teacher": teacher}, batch)
  offline = engine(make_distill_objective(CachedLogitKD(temperature=TEMPERATURE)), {},
                   cached_batch)
  steppers = {
      "online": common.Stepper(online, create_model(student_cfg, mesh=mesh, rules=rules, seed=0),
                               batch, extras={"teacher": teacher}),
      "offline": common.Stepper(offline, create_model(student_cfg, mesh=mesh, rules=rules, seed=0),
                                cached_batch),
  }
  times, warmup = common.interleaved(steppers, reps=s["reps"], steps_per_rep=s["steps_per_rep"])
  on, off = steppers["online"].losses, steppers["offline"].losses
  loss_diff = max(abs(a - b) / abs(b) for a, b in zip(off, on))
  rows = []
  for name, e in (("online", online), ("offline", offline)):
    stats = e.runner.stats
    rows.append({"mode": name, "step_s": common.median(times[name]), "step_s_all": times[name],
                 "warmup_s": warmup[name], "flops": stats.get("flops"),
                 "argument_bytes": stats.get("argument_size_in_bytes"),
                 "temp_bytes": stats.get("temp_size_in_bytes"),
                 "final_loss": steppers[name].losses[-1]})
  return {"machine": common.machine_info(), "quick": quick, "batch": B, "seq_len": L,
          "top_k": TOP_K, "temperature": TEMPERATURE, "devices": jax.device_count(),
          "student": common.config_summary(student_cfg),
          "teacher": common.config_summary(teacher_cfg), "rows": rows,
          "offline_over_online": common.paired_ratio(times, "offline", "online"),
          "online_over_offline": common.paired_ratio(times, "online", "offline"),
          "loss_check": {"max_rel_diff": loss_diff, "pass": loss_diff <= 1e-4}}


def main() -> int:
  args = subproc.parse_args(subproc.base_parser(__doc__.splitlines()[0]))

  res = run(args.quick)
  print(f"\ndemo_student <- demo_teacher, batch {res['batch']} x {res['seq_len']}, top-k "
        f"{res['top_k']}, {res['devices']} {res['machine']['platform']} device(s)")
  print(common.format_table(res["rows"], [
      ("teacher", lambda r: r["mode"]), ("step ms", lambda r: common.fmt_ms(r["step_s"])),
      ("GFLOPs/step", lambda r: f"{r['flops'] / 1e9:.2f}" if r["flops"] else "n/a"),
      ("arguments", lambda r: common.fmt_bytes(r["argument_bytes"])),
      ("temporaries", lambda r: common.fmt_bytes(r["temp_bytes"])),
      ("final loss", lambda r: f"{r['final_loss']:.5f}"),
  ]))
  print(f"online / offline step time: {res['online_over_offline']:.3f} (median of per-round "
        f"ratios); offline / online: {res['offline_over_online']:.3f}")
  check = res["loss_check"]
  print(f"{'PASS' if check['pass'] else 'FAIL'}  same losses online and offline (max rel diff "
        f"{check['max_rel_diff']:.1e})")
  path = common.write_json(args.out, "distill_step", res)
  print(f"\nwrote {path}")
  return 0 if check["pass"] else 1


if __name__ == "__main__":
  sys.exit(main())
