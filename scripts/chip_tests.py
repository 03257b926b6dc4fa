"""The tests whose claims depend on the hardware, run in one process (one program holds a chip)
with a pass/fail summary, printed and written as JSON ($OUT/chip_tests.json when OUT is set).

  scripts/chip_tests.sh --tpu     on a lent TPU: JAX_PLATFORMS=tpu,cpu, the real kernels
  scripts/chip_tests.sh           here: JAX on CPU, Pallas in interpret mode (a dry run of the
                                  same selection at the suite's sizes)

The tests are the CPU suite's own; tests/support/chip.py says what a TPU changes in them (the
kernels, the sizes, the tolerances). Which ones run is SELECTION below; tests/test_chip_tests.py
checks that every entry still names tests. Mesh tests stay out (the chip is one device), and so
do checks no hardware can change (configs, shapes, refusals).

Keeps going after a failure; stops starting tests once --budget-s have passed since it started
(270 s on a TPU: the chip run must end well within 6 minutes), reporting the rest as not run.
Exit status 0 only when every selected test ran and passed.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.metadata
import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (test id or prefix: a file, a function with all its parameters, or one parametrized case;
#  why its claim depends on the hardware)
SELECTION = (
    ("tests/models/attention/test_decode.py",
     "the decode kernel's Mosaic build (the stacked cache read in place, blocks past the filled "
     "slots skipped, soft-cap, window, padded rows) against the reference attention, and a "
     "scanned model decoding through it against uncached recomputation"),
    ("tests/quant/test_ggml_rounding.py",
     "q4_0 / q8_0 rounding (weights, activations, a q4_0 QAT forward) against numpy "
     "transcriptions of ggml's quantizers, bit for bit: the TPU's division, fp16 conversion"),
    ("tests/quant/test_int8_train.py::"
     "test_int8_matmul_qat_multiplies_int8_codes_and_trains_like_fake_quant",
     "int8 QAT with qat.int8_matmul: the TPU's compiled step multiplies s8 x s8 (its int8 "
     "convolutions; a deviceless v5e compile of the tiny train_int8 row has 26), logits and "
     "gradients near fake-quant int8 QAT's"),
    ("tests/quant/test_int8_train.py::test_int8_backward_runs_every_matmul_of_the_step_in_int8",
     "qat.int8_backward: the compiled step's backward matmuls s8 x s8 too, gradients near the "
     "straight-through ones"),
    ("tests/quant/test_q8_0_kernel.py::test_the_kernel_rounds_the_bits_the_blocks_do",
     "the q8_0 activation rounding's Mosaic kernel (lane butterflies, roundeven, the TPU's "
     "division) against the XLA rounding by blocks, bit for bit, at the real model's widths"),
    ("tests/quant/test_qlora_dequant.py::test_nf4_select_dequantize_is_qwix_table_bit_for_bit",
     "QLoRA's nf4 base dequantized by selects against qwix's table gather, bit for bit"),
    ("tests/models/attention/test_impls.py::test_splash_kernel_matches_reference",
     "splash attention's Mosaic kernel (tiles 1024/1024/512 fused, the default; 512/1024/512 "
     "fused; 512/512/512 two-kernel backward) against the reference: f32 and bf16, causal, "
     "window, traced window, packed segments, GQA, soft-cap"),
    ("tests/models/test_rope.py",
     "RoPE's whole-head form (models/layers._rope_whole_heads: the halves swapped by a +-1 "
     "matmul, one MXU pass for bf16, HIGHEST precision for fp32) against rotate_half in float64 "
     "numpy and the split form, values and gradients: the swap is exact only as the chip's "
     "matmul unit rounds it"),
    ("tests/models/test_remat.py::"
     "test_saving_policies_keep_splash_output_and_do_not_run_its_forward_again",
     "model.remat='save_attention' / 'save_attention_qkv' over splash's Mosaic kernel: the "
     "values and gradients of full remat, with the kernel run twice in the compiled step, not "
     "three times"),
    ("tests/models/moe/test_kernels.py::test_grouped_matmul_equals_dense_in_values_and_gradients",
     "the grouped matmul ('ragged': the TPU's ragged_dot; 'tokamax': its Mosaic kernel) "
     "against the dense experts, f32 and bf16, values and gradients"),
    ("tests/models/moe/test_training_steps.py",
     "a tiny MoE student's f32 training steps with the default kernel (the TPU's ragged_dot) "
     "against the dense experts on the host CPU: losses and gradient norms, dropless and with "
     "capacity drops (rows a TPU leaves undefined)"),
    ("tests/framework/test_vocab_slices.py::"
     "test_sums_and_gradients_equal_the_whole_logits_formulas",
     "vocabulary slices (CE and forward KL) against float64 formulas over whole logits"),
    ("tests/framework/test_vocab_slices.py::"
     "test_adapted_and_fake_quantized_heads_over_slices_equal_their_whole_logits",
     "train.loss_impl='sliced' over LoRA, QLoRA and QAT heads (the TPU's rounding of q4_0/q8_0 "
     "blocks) against the model's own whole logits: loss, trained gradients"),
    ("tests/framework/test_vocab_stats_kernel.py::"
     "test_loss_sums_and_gradients_equal_the_xla_pass",
     "the cross-entropy statistics' Mosaic kernel (the sliced loss's forward on a TPU) at its "
     "own tiles over Qwen3's 151,936 columns against the XLA pass over slices: loss, sums, "
     "gradients, f32 and bf16, tied and untied, a padded table"),
    ("tests/framework/test_chunked_loss.py::"
     "test_chunked_lm_loss_equals_unchunked_values_and_gradients",
     "the vocabulary-chunk engine against whole logits: the TPU's f32 arithmetic"),
    ("tests/framework/test_chunked_loss.py::test_lm_objective_is_the_chunked_loss",
     "the lm objective's loss against whole logits"),
    ("tests/framework/test_token_rows.py::test_lm_losses_take_their_softmax_over_the_token_rows",
     "a padded vocabulary's columns masked in both engines: CE and accuracy against float64 "
     "numpy over the token columns, gradients against whole logits, the padded rows' exactly "
     "zero"),
    ("tests/framework/test_token_rows.py::test_logit_kd_masks_the_same_rows_of_both_models",
     "LogitKD over the token columns of both models, whole, chunked and sliced, against float64 "
     "numpy"),
    ("tests/framework/test_slice_metrics.py::test_metrics_equal_numpy_over_whole_logits",
     "the metrics that ride the slices' first pass (teacher NLL, argmax agreement, logit cosine, "
     "KL at T = 1) against float64 numpy over whole logits: the TPU's exp and log"),
    ("tests/framework/test_slice_divergences.py",
     "the jsd's terms over a slice against float64 numpy on a 200,000-column vocabulary with the "
     "student near its teacher: the TPU's expm1 and log1p (its log/exp lost 3e-4 of the "
     "gradient's scale in the earlier form, call 39)"),
    ("tests/distill/on_policy/test_sliced.py::"
     "test_sliced_scoring_equals_whole_logits_and_the_chunk_engine",
     "on-policy scoring over vocabulary slices (auto's engine for it) against whole logits and "
     "the chunk engine: loss and gradients"),
    ("tests/distill/test_multi_teacher.py::"
     "test_several_teachers_over_slices_equal_the_chunk_engine",
     "several teachers folded per slice (mixture and routing) against the chunk engine"),
    ("tests/distill/test_sliced_terms.py::"
     "test_several_logit_terms_over_slices_equal_the_chunk_engine",
     "several LogitKDs in one pass over the slices (slice_terms.py: two temperatures, a jsd, a "
     "reverse KL) against the chunk engine, train and eval objectives: loss, sums, gradients"),
    ("tests/distill/test_tpu_chunks.py::"
     "test_a_tpu_train_objective_takes_chunks_with_the_slices_numbers",
     "train.loss_impl='auto' on a TPU: a live teacher's KD over the chunk engine (its chunks "
     "chosen for the chip) against the slices: loss, sums and gradients"),
)
TPU_BUDGET_S = 270.0
HUNG_S = 180  # a test still running after this long gets its stacks printed
# What the chip lacks that the suite's environment has (pyproject's extras that scripts/tpu_call.sh
# carries no wheel of): the selected tests must not import them (tests/test_chip_tests.py).
CHIP_LACKS = ("gguf", "llama_cpp", "torch", "transformers", "accelerate", "chex", "sentencepiece",
              "tensorboard", "xdist", "lm_eval", "sacrebleu", "rouge_score", "mkdocs")


def files() -> list[str]:
  """The test files the selection reaches, in order."""
  return list(dict.fromkeys(entry.split("::")[0] for entry, _ in SELECTION))


def matches(entry: str, nodeid: str) -> bool:
  """`entry` names this test: itself, its file, or its function (every parameter)."""
  return nodeid == entry or nodeid.startswith((entry + "::", entry + "["))


class Selector:
  """A pytest plugin: keeps the collected tests the selection names, records which entry found
  which tests (an entry that finds none is stale)."""

  def __init__(self):
    self.found: dict[str, list[str]] = {entry: [] for entry, _ in SELECTION}

  def pytest_collection_modifyitems(self, config, items):
    kept, dropped = [], []
    for item in items:
      owners = [e for e in self.found if matches(e, item.nodeid)]
      for entry in owners:
        self.found[entry].append(item.nodeid)
      (kept if owners else dropped).append(item)
    items[:] = kept
    config.hook.pytest_deselected(items=dropped)

  def missing(self) -> list[str]:
    return [entry for entry, ids in self.found.items() if not ids]


def pytest_args(extra: list[str]) -> list[str]:
  return [os.path.join(ROOT, f) for f in files()] + [
      "--rootdir", ROOT, "-o", "addopts=", "-p", "no:cacheprovider", "-p", "no:xdist",
      "--continue-on-collection-errors"] + extra


def collect() -> dict[str, list[str]]:
  """{entry: the test ids it selects}, by pytest's own collection in this process (JAX is
  started the way the caller's process has it)."""
  selector = Selector()
  code = pytest.main(pytest_args(["--collect-only", "-qq"]), plugins=[selector])
  if code not in (0, 5):  # 5: nothing collected (every entry stale), reported by the caller
    raise RuntimeError(f"pytest --collect-only exited {code}")
  return selector.found


def _environment() -> dict:
  """Versions, JAX's backend and devices (or the error that kept JAX from starting)."""
  found = {"python": sys.version.split()[0]}
  for name in ("jax", "jaxlib", "libtpu", "flax", "tokamax"):
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = None
  try:
    import jax  # pylint: disable=import-outside-toplevel
    devices = jax.devices()
    found.update(backend=jax.default_backend(), device_kind=devices[0].device_kind,
                 device_count=len(devices))
  except Exception as e:  # pylint: disable=broad-except  (reported, and no test runs)
    found.update(backend=None, error=f"JAX did not start: {type(e).__name__}: {e}")
  return found


def _message(longrepr) -> str:
  """The one line that says why a test failed or was not run."""
  if isinstance(longrepr, tuple):  # a skip: (path, line, "Skipped: why")
    return str(longrepr[2]).removeprefix("Skipped: ")[:2000]
  crash = getattr(longrepr, "reprcrash", None)
  return (crash.message if crash is not None else str(longrepr))[:2000]


class ChipRun(Selector):
  """The selector, plus each test's outcome and time, the time budget, a stack dump of a test
  that hangs, and the JSON after every test (a run cut short still leaves its results)."""

  def __init__(self, platform: str, budget_s: float | None, json_path: str | None):
    super().__init__()
    self.platform, self.budget_s, self.json_path = platform, budget_s, json_path
    self.start = time.monotonic()
    self.results: dict[str, dict] = {}
    self.environment: dict = {}
    # Where a hung test's stacks go: stderr as it is now, before pytest captures it.
    self.stderr = os.fdopen(os.dup(sys.stderr.fileno()), "w")

  def pytest_collection_finish(self, session):
    self.environment = _environment()
    if "error" not in self.environment and self.environment["backend"] != self.platform:
      self.environment["error"] = (f"JAX runs on {self.environment['backend']!r}, not "
                                   f"{self.platform!r}: no test was run")

  def pytest_runtest_setup(self, item):
    faulthandler.dump_traceback_later(HUNG_S, exit=False, file=self.stderr)
    if "error" in self.environment:
      pytest.skip(self.environment["error"])
    if self.budget_s is not None and time.monotonic() - self.start > self.budget_s:
      pytest.skip(f"not run: the chip run's {self.budget_s:.0f} s budget was spent")

  def pytest_runtest_logreport(self, report):
    entry = self.results.setdefault(report.nodeid, {"id": report.nodeid, "outcome": "passed",
                                                    "seconds": 0.0, "message": ""})
    entry["seconds"] = round(entry["seconds"] + report.duration, 2)
    if report.failed or report.skipped:
      entry["outcome"] = ("not run" if report.skipped else
                          "failed" if report.when == "call" else "error")
      entry["message"] = _message(report.longrepr)
    if report.when == "teardown":
      faulthandler.cancel_dump_traceback_later()
      self.write()

  def pytest_collectreport(self, report):
    if report.failed:  # a test file that does not import: its entries are reported missing
      self.results[report.nodeid] = {"id": report.nodeid, "outcome": "error", "seconds": 0.0,
                                     "message": str(report.longrepr)[-2000:]}

  def summary(self, exit_code: int | None = None) -> dict:
    tests = list(self.results.values())
    counts = {k: sum(t["outcome"] == k for t in tests)
              for k in ("passed", "failed", "error", "not run")}
    selected = sum(len(ids) for ids in self.found.values())
    ok = (counts["passed"] == len(tests) == selected > 0 and not self.missing()
          and "error" not in self.environment)
    return {"platform": self.platform, **self.environment, "ok": ok, "counts": counts,
            "selected": selected, "missing": self.missing(), "pytest_exit_code": exit_code,
            "wall_s": round(time.monotonic() - self.start, 1),
            "selection": [entry for entry, _ in SELECTION], "tests": tests}

  def write(self, exit_code: int | None = None) -> None:
    if not self.json_path:
      return
    from distillax import jsonio  # pylint: disable=import-outside-toplevel
    try:
      os.makedirs(os.path.dirname(os.path.abspath(self.json_path)), exist_ok=True)
      with open(self.json_path, "w", encoding="utf-8") as f:
        f.write(jsonio.dumps(self.summary(exit_code), indent=1) + "\n")
    except OSError as e:  # the results still print
      print(f"chip_tests: cannot write {self.json_path}: {e}", file=sys.stderr)
      self.json_path = None


def print_summary(summary: dict) -> None:
  c = summary["counts"]
  where = (f"{summary.get('device_kind')} x{summary.get('device_count')}, jax "
           f"{summary.get('jax')}, libtpu {summary.get('libtpu')}")
  print(f"\n==== chip tests on {summary['platform']} ({where}): {c['passed']} passed, "
        f"{c['failed']} failed, {c['error']} errors, {c['not run']} not run of "
        f"{summary['selected']} selected, in {summary['wall_s']:.0f} s: "
        f"{'PASS' if summary['ok'] else 'FAIL'}")
  if summary["platform"] == "cpu":
    print("     (a dry run on CPU: Pallas in interpret mode; --tpu runs the chip's kernels)")
  if "error" in summary:
    print(f"     {summary['error']}")
  for test in summary["tests"]:
    label = {"passed": "PASS", "failed": "FAIL", "error": "ERROR", "not run": "NOT RUN"}
    print(f"  {label[test['outcome']]:7s} {test['seconds']:6.1f} s  {test['id']}")
    message = test["message"].strip()
    if test["outcome"] != "passed" and message and message != summary.get("error"):
      print(f"            {message.splitlines()[0][:300]}")
  for entry in summary["missing"]:
    print(f"  MISSING          {entry}  (the selection names no test there)")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tpu", action="store_true", help="run on the TPU (JAX_PLATFORMS=tpu,cpu)")
  parser.add_argument("--budget-s", type=float, default=None,
                      help=f"start no test after this many seconds (TPU: {TPU_BUDGET_S:.0f})")
  parser.add_argument("--json", default=None, help="where to write the JSON (default: "
                      "$OUT/chip_tests.json when OUT is set)")
  args = parser.parse_args(argv)
  platform = "tpu" if args.tpu else "cpu"
  os.environ["JAX_PLATFORMS"] = "tpu,cpu" if args.tpu else "cpu"  # before anything starts JAX
  budget = args.budget_s if args.budget_s is not None else (TPU_BUDGET_S if args.tpu else None)
  json_path = args.json or (os.path.join(os.environ["OUT"], "chip_tests.json")
                            if os.environ.get("OUT") else None)
  sys.path.insert(0, ROOT)
  run = ChipRun(platform, budget, json_path)
  code = pytest.main(pytest_args(["-v", "--tb=short", "-rfE"]), plugins=[run])
  run.write(int(code))
  summary = run.summary(int(code))
  print_summary(summary)
  if json_path:
    print(f"     JSON: {json_path}")
  return 0 if summary["ok"] else 1


if __name__ == "__main__":
  sys.exit(main())
