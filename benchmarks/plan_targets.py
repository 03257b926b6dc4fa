"""What do the real TPU and GPU compilers say of distillax's steps, against the CPU plan?

  python benchmarks/plan_targets.py [--quick] [--rows ID,ID,...]

Each row compiles one job's train step twice, each in a process of its own: by XLA:CPU over as
many simulated devices (what `distillax plan --devices N` reports), and by the target's own
compiler from this CPU host (what `distillax plan --target T` reports: libtpu for TPU slices, the
CUDA plugin for GPUs). Per device, each side's compiler gives the peak memory (arguments +
temporaries + outputs - aliased), the collectives by kind (count and buffer bytes per step,
trip counts applied), the FLOPs of its matmuls (trip counts applied) and its compile time; the
target side adds the fused kernels that lowered, the attention and experts each layer got
(`by_layer`) and how the token losses ran (`loss`).

Rows (full run):
  - Llama 3.1 8B next-token training on tpu:v5p-128 (64 chips, v5p:4x4x4) at 8 x 2048,
    64 x 8192 and 16 x 32768 tokens, under fsdp, fsdp_tp and fsdp_tp_sp (model axis 8); fsdp
    cannot split a batch of 8 or 16 over 64 data-parallel devices, and says so;
  - Llama 3.1 8B -> Llama 3.2 1B logit distillation (teacher in the step, bf16) on tpu:v5e-64
    (64 x 2048) and on gpu:h100x8 (8 x 2048; `auto` attention is cuDNN there, whose lowering
    needs NVIDIA's cuDNN wheel, which `make test` does not install: without it the row says so);
  - the on-policy step of that pair on tpu:v5e-64 (64 prompts of 257 tokens, 256 sampled: the
    512 scored tokens are splash's 128-token blocks).
--quick: the tiny lm job on tpu:v5e-4 (the smoke test; tests/plan/test_target.py compiles for
a GPU).
Writes benchmarks/results/plan_targets[_quick].json after every row (a long run keeps what it
has measured); --rows reruns only the rows named, keeping the file's other rows (marked `stale`
when an older version of this script measured them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

# Before JAX starts: a GPU row's child finds the CUDA plugin (distillax/cli/target_env.py).
from distillax.cli.target_env import prepare_target_environment  # noqa: E402

_ROW = next((json.loads(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--row=")), None)
# Every process computes on CPU: libtpu, when installed, would otherwise probe for a TPU.
prepare_target_environment(_ROW["target"] if _ROW and _ROW["side"] == "on_target" else "cpu")

import jax  # noqa: E402

from benchmarks.lib import common, subproc  # noqa: E402
from distillax.configs import distill, llama3_8b, lm, on_policy  # noqa: E402
from distillax.configs.common import model_config  # noqa: E402
from distillax.framework import targets  # noqa: E402
from distillax.plan.local import plan_report  # noqa: E402
from distillax.plan.target import compile_on  # noqa: E402
from distillax.trainers import recipe_for  # noqa: E402

SCRIPT = Path(__file__).resolve()
SHAPES_8B = ((8, 2048), (64, 8192), (16, 32768))
STRATEGIES = ("fsdp", "fsdp_tp", "fsdp_tp_sp")


def _row(rid: str, job: str, target: str, cpu_devices: int, **settings) -> dict:
  return {"id": rid, "job": job, "target": target, "cpu_devices": cpu_devices, **settings}


def full_rows() -> list[dict]:
  rows = [_row(f"8b-{strategy}-{b}x{s}", "llama8b", "tpu:v5p-128", 64, batch=b, seq=s,
               strategy=strategy, model_axis=1 if strategy == "fsdp" else 8)
          for b, s in SHAPES_8B for strategy in STRATEGIES]
  rows += [_row("kd-8b-1b-v5e64", "kd", "tpu:v5e-64", 64, batch=64, seq=2048),
           _row("kd-8b-1b-h100x8", "kd", "gpu:h100x8", 8, batch=8, seq=2048),
           _row("onpolicy-8b-1b-v5e64", "on_policy", "tpu:v5e-64", 64, batch=64, seq=512)]
  return rows


def quick_rows() -> list[dict]:
  return [_row("tiny-v5e4", "tiny", "tpu:v5e-4", 4, batch=8, seq=128)]


def job_config(row: dict):
  """The config a row compiles (the same on both sides)."""
  if row["job"] == "tiny":
    c = lm.get_config("tiny")
    c.model.dtype = "bfloat16"
  elif row["job"] == "llama8b":
    c = llama3_8b.get_config()
    c.partitioning.strategy = row["strategy"]
    c.mesh.model = row["model_axis"]
  else:
    c = (distill if row["job"] == "kd" else on_policy).get_config()
    c.model = model_config("llama3.2-1b", param_dtype="float32", dtype="bfloat16",
                           remat="full")
    c.teacher.preset, c.teacher.param_dtype, c.teacher.dtype = "llama3.1-8b", "bfloat16", \
        "bfloat16"
    c.partitioning.strategy = "fsdp"
    if row["job"] == "on_policy":
      # Scored: prompt + completion less its last token, a multiple of splash's 128-token blocks.
      c.on_policy.prompt_len, c.on_policy.max_new_tokens = row["seq"] // 2 + 1, row["seq"] // 2
      c.on_policy.time_sampling = False
  c.train.batch_size, c.train.seq_len = row["batch"], row["seq"]
  if "attention" in row:
    c.model.attention_impl = row["attention"]
  return c


def _figures(report: dict) -> dict:
  coll = report["collectives"]
  return {"devices": report["devices"], "mesh": report["mesh"],
          "peak_bytes": report["peak_bytes_per_device"], "compiled": report["compiled"],
          "collectives": {k: {"count": v["count"], "bytes": v["bytes"]}
                          for k, v in coll.items() if isinstance(v, dict)},
          "trip_count_unknown": coll["trip_count_unknown"],
          "matmul_flops_per_device": report["hlo_matmul_flops_per_device"],
          "model_flops_per_step": report["model_flops_per_step"],
          # compiled / analytic, and whether it is in plan's 0.9-1.2 (`flops_check`)
          "flops_check": report["flops_check"],
          "compile_seconds": report["compile_seconds"]}


def child(row: dict, side: str) -> dict:
  """One side of one row, in this process (the parent runs each in a process of its own)."""
  start = time.perf_counter()
  try:
    if side == "on_cpu":
      recipe = recipe_for(job_config(row))
      out = _figures(plan_report(recipe, recipe.build_engines().main))
    else:
      target = targets.parse_target(row["target"])
      report = compile_on(job_config(row), target, targets.target_devices(target))
      if "out_of_memory" in report:
        return {"out_of_memory": report["out_of_memory"],
                "seconds": time.perf_counter() - start}
      out = dict(_figures(report), kernels=report["kernels"], attention=report["attention"],
                 by_layer=report["by_layer"], moe=report["moe"], loss=report["loss"],
                 memory_bytes_per_device=report["memory_bytes_per_device"])
  except Exception as e:  # noqa: BLE001 - a row that cannot compile reports why
    return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:400],
            "seconds": time.perf_counter() - start}
  out["seconds"] = time.perf_counter() - start
  return out


def measure(row: dict) -> dict:
  result = dict(row)
  for side, devices in (("on_target", 1), ("on_cpu", row["cpu_devices"])):
    where = row["target"] if side == "on_target" else f"{devices} simulated CPU devices"
    print(f"{row['id']}: compiling for {where}", flush=True)
    payload = dict(row, side=side)
    try:
      result[side] = subproc.run_child(SCRIPT, devices, [f"--row={json.dumps(payload)}"],
                                       echo=False)
    except RuntimeError as e:
      result[side] = {"error": str(e).splitlines()[-1][:400]}
  return result


def _cell(side: dict, key: str) -> str:
  if "error" in side or "out_of_memory" in side:
    return "DOES NOT FIT" if "out_of_memory" in side else "error"
  if key == "peak":
    return common.fmt_bytes(side["peak_bytes"])
  if key == "coll":
    c = side["collectives"]
    return " ".join(f"{k.split('-')[0][0].upper()}{k.split('-')[-1][0].upper()} {v['count']}/"
                    f"{common.fmt_bytes(v['bytes'])}" for k, v in c.items()
                    if k != "total" and v["count"]) or "-"
  return f"{side['compile_seconds']:.0f}s"


def table(rows: list[dict]) -> str:
  cols = [("row", lambda r: r["id"]), ("target", lambda r: r["target"])]
  for side in ("on_target", "on_cpu"):
    for key in ("peak", "coll", "time"):
      cols.append((f"{side.split('_')[1]} {key}",
                   lambda r, s=side, k=key: _cell(r.get(s, {"error": 1}), k)))
  return common.format_table(rows, cols)


def kept_rows(old: dict, rerun: set[str]) -> list[dict]:
  """The rows of an earlier results file that a `--rows` run keeps, each marked `stale` when an
  older version of this script measured it (the docs say the page is partly stale)."""
  current = common.script_sha256(SCRIPT)
  older = old.get("provenance", {}).get("script_sha256") != current
  return [dict(r, stale=True) if older else r for r in old["rows"] if r["id"] not in rerun]


def main() -> None:
  parser = subproc.base_parser(__doc__.splitlines()[0])
  parser.add_argument("--rows", default="", help="comma-separated row ids to run (default all)")
  parser.add_argument("--row", default=None, help=argparse.SUPPRESS)
  args = subproc.parse_args(parser)
  if args.row is not None:
    row = json.loads(args.row)
    subproc.write_child_result(args.child_out, child(row, row["side"]))
    return
  rows = quick_rows() if args.quick else full_rows()
  if args.rows:
    wanted = set(args.rows.split(","))
    rows = [r for r in rows if r["id"] in wanted]
  name = "plan_targets_quick" if args.quick else "plan_targets"
  done, path = [], Path(args.out) / f"{name}.json"
  if args.rows and path.exists():  # rerun some rows: keep the others' figures
    done = kept_rows(json.loads(path.read_text()), wanted)
  for row in rows:
    done.append(measure(row))
    common.write_json(args.out, name, {"rows": done, "jax": jax.__version__,
                                       "machine": common.machine_info()})
  print(table(done))


if __name__ == "__main__":
  main()
