"""Step time of every backend and preset, and the framework's overhead over a hand-written step.

  python benchmarks/step.py [--quick]

Part 1 (8 simulated CPU devices): for the tiny and demo_student sizes, the step time of `jit`
under dp / fsdp / tp / fsdp_tp, `shard_map`, `pmap` and `vmap`, timed round-robin, as ratios to
jit+dp. Part 2 (one device, a child process): the framework's `jit` step against a minimal
flax + optax step for the same model, batch and optimizer (benchmarks/lib/baseline.py); the
overhead ratio's target is <= 1.03. Both steps start from the same weights, so their losses after
the same steps must agree: that shows the yardstick computes the same thing.

Writes benchmarks/results/step.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=8)

import jax  # noqa: E402

from benchmarks.lib import backend_suite, baseline, common, subproc  # noqa: E402
from distillax.models import get_preset  # noqa: E402

OVERHEAD_TARGET = 1.03


def settings(quick: bool) -> dict:
  if quick:
    return {"models": {"tiny": (8, 32)}, "reps": 2, "steps_per_rep": 1,
            "only": ("jit/dp", "pmap"), "overhead_reps": 3, "overhead_steps": 2}
  return {"models": {"tiny": (16, 128), "demo_student": (16, 128)}, "reps": 5,
          "steps_per_rep": 3, "only": None, "overhead_reps": 12, "overhead_steps": 4}


def _rel(a: float, b: float) -> float:
  return abs(a - b) / max(abs(b), 1e-12)


def overhead_part(quick: bool) -> dict:
  """One device: the framework's jit+dp step vs the minimal step, interleaved."""
  s = settings(quick)
  out = []
  for name, (batch, seq_len) in s["models"].items():
    cfg = get_preset(name)
    data = common.packed_batch(batch, seq_len, cfg.vocab_size, seed=1)
    model = common.host_model(cfg)  # both steps start from these weights
    built = common.build(cfg, "dp", (1, 1), "jit", batch, seq_len, model=model)
    framework = common.Stepper(built.engine, model, data)
    minimal = baseline.MinimalStep(model, common.benchmark_optimizer(), 1000, data)
    times, _ = common.interleaved({"framework": framework, "minimal": minimal},
                               reps=s["overhead_reps"], steps_per_rep=s["overhead_steps"],
                               warmup_steps=2)
    ratio = common.paired_ratio(times, "framework", "minimal")
    # After the warm-up (2 steps: forward, gradients and one optimizer update behind the
    # reported loss) the two must agree to fp32 rounding; over many steps rounding differences
    # (the framework normalises after the gradient, the minimal step inside the loss) may grow.
    first_rel = _rel(framework.losses[0], minimal.losses[0])
    final_rel = _rel(framework.losses[-1], minimal.losses[-1])
    out.append({"model": name, "batch": batch, "seq_len": seq_len,
                "framework_step_s": common.median(times["framework"]),
                "minimal_step_s": common.median(times["minimal"]),
                "framework_step_s_all": times["framework"],
                "minimal_step_s_all": times["minimal"],
                "overhead_ratio": ratio, "target": OVERHEAD_TARGET,
                "within_target": bool(ratio <= OVERHEAD_TARGET),
                "framework_losses": framework.losses, "minimal_losses": minimal.losses,
                "loss_rel_diff_step2": first_rel, "loss_rel_diff_final": final_rel,
                "same_loss": bool(first_rel <= 1e-5 and final_rel <= 1e-3),
                "steps_taken": 2 + s["overhead_reps"] * s["overhead_steps"],
                "devices": jax.device_count()})
    print(f"  overhead {name}: framework {out[-1]['framework_step_s'] * 1e3:.2f} ms, minimal "
          f"{out[-1]['minimal_step_s'] * 1e3:.2f} ms, ratio {ratio:.3f}", flush=True)
  return {"overhead": out}


def backends_part(quick: bool) -> list[dict]:
  s = settings(quick)
  results = []
  for name, (batch, seq_len) in s["models"].items():
    print(f"{name}: batch {batch} x {seq_len} on 8 devices", flush=True)
    res = backend_suite.run(get_preset(name), batch=batch, seq_len=seq_len, reps=s["reps"],
                            steps_per_rep=s["steps_per_rep"], only=s["only"])
    res["preset"] = name
    results.append(res)
  return results


def main() -> int:
  args = subproc.parse_args(subproc.base_parser(__doc__.splitlines()[0]))
  if args.child_out:  # the one-device overhead measurement
    subproc.write_child_result(args.child_out, overhead_part(args.quick))
    return 0

  print("== part 1: backends and presets on 8 simulated devices ==", flush=True)
  backend_results = backends_part(args.quick)
  print("== part 2: framework vs minimal flax+optax step, 1 device ==", flush=True)
  overhead = subproc.run_child(Path(__file__), 1, ["--quick"] if args.quick else [])["overhead"]

  ok = True
  for res in backend_results:
    key = backend_suite.ratio_key(res)
    print(f"\n{res['preset']}: global batch {res['batch']} x {res['seq_len']}, "
          f"{res['devices']} devices, median of {res['reps']} interleaved rounds")
    print(common.format_table(res["rows"], [
        ("variant", lambda r: r["variant"]), ("mesh", lambda r: r["mesh"]),
        ("step ms", lambda r: common.fmt_ms(r["step_s"])),
        ("vs jit/dp", lambda r: common.fmt_ratio(r[key])),
        ("tokens/s", lambda r: f"{r['tokens_per_s']:.0f}"),
        ("final loss", lambda r: f"{r['final_loss']:.5f}")]))
    print("step ms: median step time; vs jit/dp: median of per-round ratios (robust to noise "
          "from other processes on the shared cores)")
    c = res["loss_check"]
    ok &= c["pass"]
    print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['check']} (max rel diff {c['max_rel_diff']:.2e})")

  print("\nframework jit step vs hand-written flax+optax step, 1 device "
        f"(target ratio <= {OVERHEAD_TARGET})")
  print(common.format_table(overhead, [
      ("model", lambda r: r["model"]), ("batch", lambda r: f"{r['batch']}x{r['seq_len']}"),
      ("framework ms", lambda r: common.fmt_ms(r["framework_step_s"])),
      ("minimal ms", lambda r: common.fmt_ms(r["minimal_step_s"])),
      ("ratio", lambda r: common.fmt_ratio(r["overhead_ratio"])),
      ("loss diff step 2", lambda r: f"{r['loss_rel_diff_step2']:.1e}"),
      ("loss diff final", lambda r: f"{r['loss_rel_diff_final']:.1e}")]))
  for r in overhead:
    ok &= r["same_loss"]
    print(f"{'PASS' if r['same_loss'] else 'FAIL'}  {r['model']}: same losses as the minimal "
          f"step (step 2 within 1e-5, step {r['steps_taken']} within 1e-3)")
    print(f"{'PASS' if r['within_target'] else 'FAIL'}  {r['model']}: overhead ratio "
          f"{r['overhead_ratio']:.3f} <= {OVERHEAD_TARGET}")

  payload = {"benchmark": "step", "quick": args.quick, "machine": common.machine_info(),
             "backends": backend_results, "overhead": overhead}
  path = common.write_json(args.out, "step", payload)
  print(f"\nwrote {path}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
