"""Online teacher vs offline teacher caches: the distillation step time, demo_student and a
teacher 4x its parameters (demo_teacher with 8 layers).

  python benchmarks/distill_step.py [--quick] [--devices N]

Online: the frozen teacher runs inside the compiled step (LogitKD, top-k = K). Offline: the
step reads the teacher's top-K log-probabilities from a cache written by `write_teacher_cache` for
the same batch (CachedLogitKD): no teacher forward pass and no teacher parameters on the device.
Hidden: the step reads the teacher's float32 final hidden states from a hidden-state cache and
rebuilds its logits with the cached LM head (LogitKD, the same K and T), chunk by chunk.
All steps are built by `build_engine` (the trainer's step), start from the same student weights
and see the same batch, so their losses must agree (checked, rel 1e-4): they compute the same
thing and differ only in where the teacher's numbers come from. Times are interleaved
repetitions (online, offline, hidden, online, ...); ratios are medians of per-round ratios.

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
from distillax.distill.teacher_head import abstract_head, load_head  # noqa: E402
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
  student_cfg = get_preset("demo_student")
  teacher_cfg = get_preset("demo_teacher").replace(num_layers=8)  # 4.2x the student
  mesh = pt.create_mesh({"data": jax.device_count(), "model": 1})
  rules = pt.rules_from_config({"strategy": "fsdp"})
  batch = common.packed_batch(B, L, student_cfg.vocab_size, seed=0)
  teacher = create_model(teacher_cfg, mesh=mesh, rules=rules, seed=1)
  with tempfile.TemporaryDirectory() as cache_dir:
    write_teacher_cache(teacher, [batch], cache_dir + "/topk", top_k=TOP_K,
                        temperature=TEMPERATURE)
    cached_batch = next(iter(read_teacher_cache(cache_dir + "/topk", batch_size=B)))
    write_teacher_cache(teacher, [batch], cache_dir + "/hidden", kind="hidden",
                        hidden_dtype="float32")
    hidden_batch = next(iter(read_teacher_cache(cache_dir + "/hidden", batch_size=B)))
    head = load_head(cache_dir + "/hidden")

  def engine(objective, abstract_extras, shapes_of):
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in shapes_of.items()}
    return build_engine(abstract_model(student_cfg), abstract_extras, objective,
                        common.benchmark_optimizer(), 1000, mesh, rules, "jit", shapes)

  kd = LogitKD(temperature=TEMPERATURE, top_k=TOP_K)
  engines = {
      "online": (engine(make_distill_objective(kd), {"teacher": abstract_model(teacher_cfg)},
                        batch), batch, {"teacher": teacher}),
      "offline": (engine(make_distill_objective(CachedLogitKD(temperature=TEMPERATURE)), {},
                         cached_batch), cached_batch, {}),
      "hidden": (engine(make_distill_objective(kd), {"teacher": abstract_head(head.config)},
                        hidden_batch), hidden_batch, {"teacher": head}),
  }
  steppers = {name: common.Stepper(e, create_model(student_cfg, mesh=mesh, rules=rules, seed=0),
                                   b, extras=extras) for name, (e, b, extras) in engines.items()}
  times, warmup = common.interleaved(steppers, reps=s["reps"], steps_per_rep=s["steps_per_rep"])
  on = steppers["online"].losses
  loss_diff = {name: max(abs(a - b) / abs(b) for a, b in zip(steppers[name].losses, on))
               for name in ("offline", "hidden")}
  rows = []
  for name, (e, _, _) in engines.items():
    stats = e.runner.stats
    rows.append({"mode": name, "step_s": common.median(times[name]), "step_s_all": times[name],
                 "tokens_per_s": B * L / common.median(times[name]),
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
          "online_over_hidden": common.paired_ratio(times, "online", "hidden"),
          "hidden_over_offline": common.paired_ratio(times, "hidden", "offline"),
          "loss_check": {"max_rel_diff": max(loss_diff.values()), "by_mode": loss_diff,
                         "pass": max(loss_diff.values()) <= 1e-4}}


def main() -> int:
  args = subproc.parse_args(subproc.base_parser(__doc__.splitlines()[0]))

  res = run(args.quick)
  print(f"\ndemo_student <- demo_teacher (8 layers), batch {res['batch']} x {res['seq_len']}, "
        f"top-k {res['top_k']}, {res['devices']} {res['machine']['platform']} device(s)")
  print(common.format_table(res["rows"], [
      ("teacher", lambda r: r["mode"]), ("step ms", lambda r: common.fmt_ms(r["step_s"])),
      ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
      ("GFLOPs/step", lambda r: f"{r['flops'] / 1e9:.2f}" if r["flops"] else "n/a"),
      ("arguments", lambda r: common.fmt_bytes(r["argument_bytes"])),
      ("temporaries", lambda r: common.fmt_bytes(r["temp_bytes"])),
      ("final loss", lambda r: f"{r['final_loss']:.5f}"),
  ]))
  print(f"online / offline step time: {res['online_over_offline']:.3f} (median of per-round "
        f"ratios); offline / online: {res['offline_over_online']:.3f}; online / hidden: "
        f"{res['online_over_hidden']:.3f}; hidden / offline: {res['hidden_over_offline']:.3f}")
  check = res["loss_check"]
  print(f"{'PASS' if check['pass'] else 'FAIL'}  same losses online, offline and hidden (max rel "
        f"diff {check['max_rel_diff']:.1e})")
  path = common.write_json(args.out, "distill_step", res)
  print(f"\nwrote {path}")
  return 0 if check["pass"] else 1


if __name__ == "__main__":
  sys.exit(main())
