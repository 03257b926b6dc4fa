"""One chip: the train, KD, on-policy, QAT, QLoRA, MoE and long-context steps of the benchmark
pairs, each at the fastest batch and remat that fit the chip it runs on, with MFU.

  python benchmarks/accelerator.py [--expect-tpu | --expect-gpu] [--quick] [--rows NAME,...]
      [--json PATH] [--out DIR]

A row (ROWS) is a model pair and a few candidate steps (lever-grid variants,
benchmarks/lib/lever_grid.py: `kind:remat:batch[:option=value...]`). Every candidate is traced
and compiled (in parallel threads), its compiled memory read against the chip's; those that fit
run one after another on one shared state and are timed after a warm-up; the row's figure is its
fastest candidate by tokens/s. Nothing is sized from a table written for another device: a
candidate the chip cannot hold is reported as such (does_not_fit, or the compiler's own HBM
error), and a smaller one stands in.

The pairs: `real`, what users distil on one chip (a Qwen3-1.7B-shaped teacher frozen in bf16 ->
a Qwen3-0.6B-shaped student with fp32 master weights and bf16 compute, vocabulary 151,936);
`continuity`, the first chip figures' 383M Llama-3.2-shaped student and 761M teacher; `moe`, a
Qwen3-MoE-shaped teacher of 16 experts (top-4, 1.38B) into the real student; `moe_student`, a
16-expert Qwen3-MoE-shaped student (0.50B). Sequence 2048 unless a row says otherwise. MFU is
model FLOPs (causal convention, framework.flops) over the datasheet peak; the probe's bf16 matmul
rate is reported beside it. The on-policy row times the sampler apart from the update and sets
its tokens/s against the decode roofline of the chip's HBM bandwidth
(benchmarks/lib/on_policy_lever.py); its tokens/s are completion tokens learned per second of
the whole step.

--expect-tpu / --expect-gpu: if JAX runs on anything else (a CPU fallback, or no backend at all),
print one line and exit 3 before any row. --quick, or any CPU: the tiny pair runs every row's
code at seconds-long sizes, a check of the bookkeeping rather than a figure.

Writes accelerator.json (--json PATH, or OUT/accelerator.json): the probe (device kind, package
versions, bf16 matmul rate), every candidate's measurement, and each row's best.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import jax  # noqa: E402

from benchmarks import tpu_levers  # noqa: E402
from benchmarks.lib import accelerator_table, common, subproc  # noqa: E402
from benchmarks.lib.accelerator_measure import check_platform  # noqa: E402

REFUSED_EXIT = 3


@dataclasses.dataclass(frozen=True)
class Row:
  name: str
  pair: str
  candidates: tuple[str, ...]  # lever-grid variants, the pair option added
  question: str


S = ":loss_impl=sliced"  # what train.loss_impl='auto' runs for these jobs
# ... but for KD from a teacher run in the step on a TPU: the chunk engine at the chunks
# distill/tpu_chunks.py sizes, 1,024 tokens at 4 rows (levers_call55_kd_chunks.jsonl)
K = ":loss_impl=chunked:chunk=1024"
_OP_LEVERS = ":opt_state_dtype=bfloat16:teacher_int8=True"  # on-policy: bf16 moments, int8 teacher
ROWS = (
    # Deviceless v5e compiles (benchmarks/compile_sizes.py): full remat 13.84 GiB at 8 rows,
    # 13.03 at 6; save_attention (models/remat.py: splash's output and statistics kept, its
    # forward not run again) 16.26 at 8 (does not fit), 15.07 at 6, 13.95 at 4;
    # save_attention_qkv 15.47 at 4 (does not fit); save_attention_up 15.05 at 4 (on the chip
    # 48.5% against save_attention at 6's 48.9%: call 50), 15.96 at 5 (does not fit).
    Row("train", "real", (f"train:full:8{S}", f"train:save_attention:6{S}",
                          f"train:save_attention:4{S}", f"train:save_dots_no_batch:4{S}",
                          f"train:full:12{S}"),
        "the student's next-token training step"),
    # save_attention at 8 rows fits with Adam's moments in bf16: 14.30 GiB; at 6, 12.85;
    # save_attention_qkv at 6, 15.28 (past the candidate limit); save_attention_up at 6, 14.67;
    # save_attention_mlp at 5, 15.26, at 4, 14.17. On the chip (call 50) save_attention_up at 6
    # ran 525.9 ms against save_attention's 537.7 (save_attention_mlp: 439.0 at 5, 352.6 at 4).
    Row("train_bf16_moments", "real", (f"train:save_attention_up:6{S}:opt_state_dtype=bfloat16",
                                       f"train:save_attention:6{S}:opt_state_dtype=bfloat16",
                                       f"train:save_attention_mlp:5{S}:opt_state_dtype=bfloat16",
                                       f"train:save_attention_qkv:5{S}:opt_state_dtype=bfloat16",
                                       f"train:save_attention:8{S}:opt_state_dtype=bfloat16",
                                       f"train:full:8{S}:opt_state_dtype=bfloat16"),
        "the train step with Adam's two moments stored in bf16 (optimizer.state_dtype; fp32 "
        "master weights kept): the memory it frees lets the step keep splash's output"),
    Row("train_bf16", "real", (f"train:full:8{S}:param_dtype=bfloat16",
                               f"train:save_dots_no_batch:4{S}:param_dtype=bfloat16",
                               f"train:save_dots_no_batch:2{S}:param_dtype=bfloat16",
                               f"train:full:16{S}:param_dtype=bfloat16"),
        "the train step with bf16 weights and Adam state (no fp32 master copy): the lever that "
        "frees the memory fp32 master weights and their Adam state take"),
    Row("kd", "real", (f"kd:full:4{K}", f"kd:full:4{S}", f"kd:full:6{S}"),
        "LogitKD (T=2, alpha 0.7) with the teacher in the step"),
    # 4 rows first: 14,313 tokens/s on the chip against 6 rows' 14,260 (58fbf0d), in less memory.
    Row("kd_int8_teacher", "real", (f"kd:full:4{K}:teacher_int8=True",
                                    f"kd:full:4{S}:teacher_int8=True",
                                    f"kd:full:6{S}:teacher_int8=True",
                                    "kd:full:6:teacher_int8=True"),
        "the KD step with the frozen teacher's matmuls in int8 (teacher.int8: per-channel "
        "weights, per-token activations; the sliced loss keeps its head in bf16)"),
    Row("qat_kd", "real", (f"kd:full:4{K}:qat=q4_0", f"kd:full:4{S}:qat=q4_0"),
        "the KD step with the student fake-quantized to llama.cpp's q4_0 (q8_0 activations)"),
    Row("qat_kd_weights", "real", (f"kd:full:4{K}:qat=q4_0_weights",
                                   f"kd:full:4{S}:qat=q4_0_weights"),
        "the KD step with only the student's weights fake-quantized to q4_0 (activations left "
        "in bf16): what the activations' q8_0 rounding costs"),
    # save_attention at 6 rows: 14.95 GiB (deviceless v5e compile).
    Row("train_int8", "real", (f"train:save_attention:6{S}:qat=int8", f"train:full:8{S}:qat=int8",
                               f"train:save_dots_no_batch:4{S}:qat=int8",
                               f"train:full:12{S}:qat=int8"),
        "the train step as int8 QAT whose matmuls run in int8 (qat.int8_matmul: int8 weights "
        "per channel and activations per token multiplied as s8 x s8 -> s32 dots in the "
        "forward and the remat's recompute, straight-through backward in bf16); set against "
        "`train`"),
    Row("train_int8_backward", "real", (f"train:save_attention:6{S}:qat=int8_backward",
                                        f"train:full:8{S}:qat=int8_backward"),
        "int8 QAT with every matmul of the step in int8, the backward's too (qat.int8_backward: "
        "the cotangent rounded per token for dx and per channel for dw, as MaxText's int8 "
        "training); set against `train`"),
    # Compiled for a v5e without one (libtpu's deviceless compile of lever_grid.lower's step
    # over the tpu:v5e-1 target's device), before issue 53's two batches: 15.53 GiB at 8 rows
    # (past 0.97 of the chip's 15.75 GiB, where run_group stops), 15.07 GiB at 6, so ~0.23 GiB
    # a row over ~13.7 GiB that any batch holds (the fp32 student, its Adam state and
    # gradients, the bf16 teacher). Now the step samples its whole batch at once (BATCH rows,
    # before the update: no gradients live yet) and learns in micro-batches of `micro`: the
    # sampler holds the student's weights in bf16 (1.1 GiB) and 112 KiB of KV cache per row
    # and position (7 GiB at 64 rows of 1,024), beside the ~9.9 GiB of fp32 weights, Adam
    # state and teacher; the update's peak is that of `micro` rows.
    # Deviceless v5e compiles (benchmarks/compile_sizes.py) of the two-batch step: 32 rows
    # sampled and micro-batches of 4, 18.0 GiB of temporaries (does not fit); with bf16 Adam
    # moments (optimizer.state_dtype) and an int8 teacher, 32 rows and micro-batches of 8,
    # 15.95 GiB (does not fit), 64 and 8, 21.3 GiB. Since the decode writes into the stacked
    # cache in place (models/attention/cache_slot.py), the sampler holds one copy of the cache
    # fewer: with both levers and micro-batches of 4, 32 rows compile to 14.18 GiB, 24 to
    # 14.78 and 16 to 15.13 (the compiler schedules each differently; all fit); 32 rows in
    # micro-batches of 8, 14.89 (with an int8 cache, 16.11: does not fit). With the decode
    # kernel (models/attention/decode.py) the sampler runs near its roofline, and an int8 KV
    # cache (kv_int8) halves what it reads: with it, 48 rows in micro-batches of 4 compile to
    # 14.71 GiB (the update's peak does not grow with the sampling batch).
    Row("on_policy", "real", tuple(
        f"on_policy:full:{b}:seq_len=1024:new_tokens=512:micro={m}{extra}"
        for b, m, extra in ((48, 4, _OP_LEVERS + ":kv_int8=True"),
                            (32, 4, _OP_LEVERS + ":kv_int8=True"), (32, 8, _OP_LEVERS),
                            (32, 4, _OP_LEVERS),
                            (24, 4, _OP_LEVERS),
                            (16, 4, _OP_LEVERS), (8, 4, ""),
                            (8, 2, ""), (16, 4, ""))),
        "on-policy distillation (configs/on_policy.py's GKD JSD): the student samples 512 "
        "tokens after a 512-token prompt for the whole sampling batch at once, with the "
        "step's weights, then learns from them in micro-batches (gradient accumulation), the "
        "teacher grading each token; sampling timed apart from the update and set against "
        "the decode roofline"),
    # The same with bf16 weights and Adam state (no fp32 master copy, as train_bf16): ~3.6 GiB
    # fewer held through sampling, room for more rows of KV cache and a larger micro-batch.
    Row("on_policy_bf16", "real", tuple(
        f"on_policy:full:{b}:seq_len=1024:new_tokens=512:micro={m}:param_dtype=bfloat16"
        for b, m in ((64, 8), (48, 8), (32, 8), (64, 4))),
        "the on-policy step with bf16 weights and Adam state: the lever that frees for the "
        "sampler's KV cache and the update's micro-batch what fp32 master weights and their "
        "Adam state take"),
    # The sliced loss, as train.loss_impl='auto' runs it for an adapted student (on the chip the
    # chunk engine's loss was slower: call 29). Deviceless v5e compiles: save_dots at 4 rows
    # 7.19 GiB, at 8 13.03; save_dots_no_batch at 6 9.96, at 8 13.24, at 12 17.89 (does not
    # fit); save_attention at 24 14.86, at 32 17.10 (does not fit); save_attention_qkv at 16
    # 15.96 (does not fit). save_dots at 4 ran fastest on the chip (calls 29, 30).
    Row("qlora", "real", (f"train:save_dots:4:lora=qlora{S}",
                          f"train:save_dots_no_batch:6:lora=qlora{S}",
                          f"train:save_dots_no_batch:8:lora=qlora{S}",
                          f"train:save_attention:8:lora=qlora{S}", f"train:full:8:lora=qlora{S}",
                          f"train:save_attention:16:lora=qlora{S}"),
        "QLoRA next-token training as configs/qlora.py runs it (frozen nf4 base in tiles of 32, "
        "rank-8 adapters on the attention and MLP matmuls, no adapter dropout as PEFT and "
        "torchtune ship it); MFU counts the full 6N model FLOPs, though the frozen base computes "
        "no weight gradients"),
    # save_attention at 16 rows: 12.77 GiB (deviceless); save_dots_no_batch at 8, 15.03; on the chip
    # save_dots at 4 (9.86 GiB compiled there) ran fastest (call 30).
    Row("lora", "real", (f"train:save_dots:4:lora=lora{S}", f"train:save_attention:8:lora=lora{S}",
                         f"train:full:8:lora=lora{S}", f"train:save_dots_no_batch:8:lora=lora{S}",
                         f"train:save_attention:16:lora=lora{S}", f"train:full:16:lora=lora{S}"),
        "LoRA next-token training as configs/lora.py runs it (a frozen bf16-computed fp32 base, "
        "rank-8 adapters on the attention and MLP matmuls, no adapter dropout): QLoRA's peer "
        "without the nf4 base"),
    Row("moe_kd", "moe", (f"kd:full:4{K}:teacher_moe_impl=ragged",
                          f"kd:full:4{S}:teacher_moe_impl=ragged",
                          f"kd:full:2{S}:teacher_moe_impl=ragged",
                          f"kd:full:4{S}:teacher_moe_impl=tokamax"),
        "KD from a 16-expert Qwen3-MoE-shaped teacher (grouped matmul: XLA's ragged_dot or "
        "tokamax's Mosaic kernel)"),
    Row("moe_kd_int8_teacher", "moe", (f"kd:full:4{S}:teacher_moe_impl=ragged:teacher_int8=True",),
        "KD from the 16-expert teacher with its matmuls in int8 (teacher.int8)"),
    # save_attention at 8 rows: 11.82 GiB (deviceless v5e compile). For the MoE KD pair it
    # does not fit at 4 or 3 rows (16.38, 15.43 GiB). save_attention_mlp (the experts' gate and
    # up products and the gathered rows kept) at 8 rows, 14.46 GiB: on the chip no faster than
    # save_attention (425.5 ms against 423.2, call 50). At 12 and 16 rows with fp32 master weights
    # and moments: 13.42 and 14.58 GiB compiled on the chip (call 58), the fastest per token.
    Row("moe_train", "moe_student", (f"train:save_attention:16{S}:moe_impl=ragged",
                                     f"train:save_attention:12{S}:moe_impl=ragged",
                                     f"train:save_attention:8{S}:moe_impl=ragged",
                                     f"train:full:8{S}:moe_impl=ragged",
                                     f"train:full:8{S}:moe_impl=tokamax",
                                     f"train:full:16{S}:moe_impl=ragged:param_dtype=bfloat16",
                                     f"train:full:4{S}:moe_impl=ragged"),
        "training a 16-expert Qwen3-MoE-shaped student (0.50B; grouped matmul: XLA's "
        "ragged_dot or tokamax's Mosaic kernel)"),
    # Compiled for a v5e from a CPU host (benchmarks/compile_sizes.py): 16k with fp32 master
    # weights 15.77 GiB with fp32 Adam moments, 13.55 GiB with bf16 ones; 32k 18.03 GiB with
    # bf16 moments, 16.36 GiB with bf16 weights and moments (the candidate limit: 15.27 GiB).
    Row("long_context", "real", (f"train:full:1:seq_len=16384{S}:opt_state_dtype=bfloat16",
                                 f"train:full:1:seq_len=16384{S}:param_dtype=bfloat16"),
        "the student's training step at 16k tokens (splash attention; fp32 master weights and "
        "bf16 Adam moments (optimizer.state_dtype), or bf16 weights and Adam state)"),
    Row("long_context_8k", "real", (f"train:full:2:seq_len=8192{S}",
                                    f"train:full:1:seq_len=8192{S}"),
        "the student's training step at 8k tokens (splash attention, fp32 master weights)"),
    # 32k: bf16 weights with fp32 Adam moments compile to 16.36 GiB; bf16 moments too, 14.43.
    Row("long_context_32k", "real", (
        f"train:full:1:seq_len=32768{S}:param_dtype=bfloat16:opt_state_dtype=bfloat16",),
        "the student's training step at 32k tokens (splash attention, bf16 weights and Adam "
        "moments: fp32 master weights do not fit one v5e at 32k)"),
    # The EAGLE-3 head (configs/draft_eagle3.py's job) against the frozen Qwen3-1.7B-shaped
    # teacher: 3 TTT steps, a 32k draft vocabulary; the target's forward is most of the FLOPs.
    # Deviceless v5e compiles: 8 x 2048 needs 17.5 GB of temporaries (does not fit), 4 x 2048
    # compiles to 13.45 GiB.
    Row("draft", "real", ("draft:none:4", "draft:none:2"),
        "the EAGLE-3 draft head's step (trainer='draft'): one decoder layer over the frozen "
        "target's hidden states at three layers, 3 steps of training-time test, 32k draft ids"),
    Row("continuity_train", "continuity", (f"train:full:8{S}",),
        "the first chip figures' 383M student, trained"),
    Row("continuity_kd", "continuity", (f"kd:full:4{S}", f"kd:full:8{S}"),
        "the first chip figures' 761M -> 383M KD step"),
)


QUICK_NEW_TOKENS = 16  # an on-policy candidate's completions at --quick (of 64 tokens)


def variant_of(row: Row, candidate: str, quick: bool) -> str:
  text = f"{candidate}:pair={row.pair}"
  if quick:  # seconds-long sizes: the tiny pair at 64 tokens (tpu_levers --tiny)
    kind, remat, batch, *rest = text.split(":")
    rest = [f"new_tokens={QUICK_NEW_TOKENS}" if r.startswith("new_tokens=") else r
            for r in rest if not r.startswith("seq_len=")]
    micro = [r for r in rest if r.startswith("micro=")]
    if micro:  # accumulation kept: 4 rows sampled at once, learned 2 at a time
      rest = [f"micro={min(int(micro[0].split('=')[1]), 2)}" if r in micro else r for r in rest]
    text = ":".join([kind, remat, str(min(int(batch), 4 if micro else 2)), *rest])
  return text


def parse_args(argv=None):
  parser = subproc.base_parser(__doc__.splitlines()[0])
  expect = parser.add_mutually_exclusive_group()
  expect.add_argument("--expect-gpu", dest="expect", action="store_const", const="gpu",
                      help="fail (exit 3, one line) unless JAX runs on a GPU")
  expect.add_argument("--expect-tpu", dest="expect", action="store_const", const="tpu",
                      help="fail (exit 3, one line) unless JAX runs on a TPU")
  parser.add_argument("--json", default=None, help="result file (default: OUT/accelerator.json)")
  parser.add_argument("--rows", default="", help="comma-separated row names (default: all)")
  # 12 parallel compiles of 22 candidates (on-policy's two programs each, QLoRA, MoE) ran the
  # lent v5e host's 40 GB of RAM out; 17 candidates at 12 fitted.
  parser.add_argument("--threads", type=int, default=6, help="parallel compiles")
  parser.add_argument("--candidates", type=int, default=0,
                      help="only each row's first N candidates (0: all), for a short call")
  parser.add_argument("--splash-from", default="",
                      help="splash_blocks.json: candidates take its fastest tiles")
  parser.add_argument("--from-levers", default="",
                      help="summarise these levers.jsonl files, comma-separated (a run cut "
                           "short, or several calls' rows: a later file's row of a name "
                           "replaces an earlier one's) instead of running")
  parser.add_argument("--profile", default="",
                      help="comma-separated variant-name patterns to profile (a tgz each, "
                           "beside the JSON)")
  parser.add_argument("--kinds", default="kd,train", choices=("train,kd", "kd,train"),
                      help="which kind of step runs first (the others compile meanwhile)")
  return subproc.parse_args(parser, argv)


def best_of(rows: list[dict], variants: list[str]) -> dict | None:
  ran = [r for r in rows if r.get("row") in variants and r.get("status") == "ok"]
  return max(ran, key=lambda r: r["tokens_per_s"]) if ran else None


def summary(levers: list[dict], chosen: list[Row], names: dict[str, list[str]]) -> dict:
  probe = next((r for r in levers if r.get("row") == "probe"), None)
  rows = []
  for row in chosen:
    candidates = [r for r in levers if r.get("row") in names[row.name]]
    best = best_of(levers, names[row.name])
    # A row measured in an earlier chip call, at an older commit (--from-levers files whose
    # rows carry "stale" and "commit"): the docs say the file is partly stale.
    rows.append({"name": row.name, "pair": row.pair, "question": row.question,
                 "candidates": candidates, "best": best,
                 **({"stale": True, "commit": best.get("commit")} if best and best.get("stale")
                    else {})})
  out = {"benchmark": "accelerator", "probe": probe, "rows": rows,
         "inits": [r for r in levers if str(r.get("row", "")).startswith("init/")]}
  by_name = {r["name"]: r["best"] for r in rows}
  for name in ("qat_kd", "qat_kd_weights"):  # step time at the same batch (issue 54: <= 1.15)
    if by_name.get("kd") and by_name.get(name) and (
        by_name["kd"]["batch"] == by_name[name]["batch"]):
      out[f"{name}_over_kd"] = by_name[name]["step_s"] / by_name["kd"]["step_s"]
  for name in ("qlora", "lora", "train_int8", "train_int8_backward"):  # at each one's best batch
    if by_name.get("train") and by_name.get(name):
      out[f"{name}_over_train"] = (by_name[name]["tokens_per_s"]
                                   / by_name["train"]["tokens_per_s"])
  return out


def _newest_rows(levers: list[dict]) -> list[dict]:
  """Lever rows with a later row of the same name (a later file of --from-levers, or a rerun)
  replacing an earlier one."""
  return list({r.get("row"): r for r in levers}.values())


def main(argv=None) -> int:
  args = parse_args(argv)
  path = Path(args.json or Path(args.out) / "accelerator.json")
  path.parent.mkdir(parents=True, exist_ok=True)
  platform = check_platform(args.expect)
  if "refused" in platform:
    path.write_text(json.dumps({"benchmark": "accelerator", "status": "refused",
                                "probe": platform, "rows": []}, indent=1) + "\n")
    print(f"accelerator.py: FAIL: {platform['refused']}", file=sys.stderr)
    return REFUSED_EXIT
  # Rows read back from lever files are as quick as the run that measured them said.
  quick = args.quick or (not args.from_levers and jax.default_backend() not in ("tpu", "gpu"))
  chosen = [r for r in ROWS if not args.rows or r.name in args.rows.split(",")]
  names = {r.name: list(dict.fromkeys(variant_of(r, c, quick) for c in
                                      r.candidates[:args.candidates or None])) for r in chosen}
  levers_paths = [Path(p) for p in args.from_levers.split(",")] if args.from_levers else [
      path.with_name(path.stem + "_levers.jsonl")]
  levers_path = levers_paths[0]
  if not args.from_levers:  # every candidate's row lands here as it finishes
    levers_path.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="accelerator-") as tmp:
      grid = ",".join(v for vs in names.values() for v in vs)
      out = str(path.parent) if args.profile else tmp  # profiles are kept beside the JSON
      tpu_levers.main(["--grid", grid, "--out", out, "--threads", str(args.threads),
                       "--profile", args.profile,
                       "--kinds", args.kinds, "--rows-file", str(levers_path)]
                      + (["--tiny"] if quick else [])
                      + (["--splash-from", args.splash_from] if args.splash_from else []))
  levers = _newest_rows([json.loads(line) for p in levers_paths
                         for line in p.read_text().splitlines()])
  seq = 64 if quick else 2048
  names = {k: [tpu_levers.lever_grid.Variant.parse(v, seq).name for v in vs]
           for k, vs in names.items()}
  payload = {**summary(levers, chosen, names), "quick": quick, "argv": sys.argv[1:],
             "status": "done", "provenance": common.provenance(__file__)}
  path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
  print(accelerator_table.report(payload))
  print(f"wrote {path}")
  return 0 if all(r["best"] for r in payload["rows"]) else 1


if __name__ == "__main__":
  sys.exit(main())
