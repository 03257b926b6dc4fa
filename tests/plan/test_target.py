"""`distillax plan --target`: the tiny jobs compiled by the real TPU compiler (libtpu, in this
process: compile-only devices on a CPU host) and the real GPU compiler (the CUDA plugin, in a
subprocess: it must be importable before JAX is), with what each compiler reports."""

import os
import re
import subprocess
import sys
import threading

import jax
import pytest

from distillax.configs import distill, lm, lora, on_policy, qat
from distillax.framework import hlo, targets
from distillax.main import main
from distillax.plan.local import DOES_NOT_FIT_EXIT_CODE
from distillax.plan.target import compile_on, search_fit
from tests.support.xla import compile_steps_with_default_cpu_emitters

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LM_TINY = f"{ROOT}/distillax/configs/lm.py:tiny"
# Splash works on 128-token blocks; the tiny configs' 32 tokens would send `auto` to blockwise.
SEQ = 128


def _devices(name: str):
  target = targets.parse_target(name)
  return target, targets.target_devices(target)


def _tiny(module, *args):
  c = module.get_config(",".join(("tiny",) + args))
  c.train.seq_len = SEQ
  c.model.dtype = "bfloat16"
  return c


def _qat_q4_0():
  c = _tiny(qat)
  c.qat.rules = on_policy.Q4_0_RULES
  c.qat.start_step = 0  # one engine: the fake-quantized step from the first
  return c


def _on_policy():
  c = _tiny(on_policy)
  # Scored: prompt + completion less the last token, 128 (next-token pairs).
  c.on_policy.prompt_len, c.on_policy.max_new_tokens = 65, 64
  c.model.max_seq_len = 256
  c.on_policy.time_sampling = False
  return c


@pytest.fixture(autouse=True)
def _default_matmul_precision():
  """The precision the CLI compiles with. conftest.py sets 'highest' for the suite's numeric
  comparisons, and under it Mosaic refuses splash's bf16 dots ("Bad lhs type"): a run that
  sets jax_default_matmul_precision=highest cannot use splash on a TPU either."""
  with jax.default_matmul_precision("default"):
    yield


def _moe():
  c = _tiny(lm)
  c.model.num_experts, c.model.moe_mlp_dim = 4, 64  # ragged_dot experts (model.moe_impl)
  c.partitioning.strategy = "fsdp_ep"  # one expert per device: the all_to_all exchange
  return c


TINY_JOBS = {"lm": lambda: _tiny(lm), "distill": lambda: _tiny(distill),
             "on_policy": _on_policy, "qat_q4_0": _qat_q4_0, "lora": lambda: _tiny(lora),
             "moe": _moe}
_SPLASH = {"attention": "splash"}
# What each layer ran: the teacher (tiny: 2 layers) and the student (1 layer) of the distill
# jobs apart; the on-policy student also samples, its prefill blockwise, its decode steps
# against the KV cache the reference.
BY_LAYER = {"lm": {"layers 0-1 of 2": _SPLASH}, "qat_q4_0": {"layers 0-1 of 2": _SPLASH},
            "lora": {"layers 0-1 of 2": _SPLASH},
            "distill": {"layer 0 of 1": _SPLASH, "layers 0-1 of 2": _SPLASH},
            "on_policy": {"layer 0 of 1": {"attention": "blockwise + reference + splash"},
                          "layers 0-1 of 2": _SPLASH},
            "moe": {"layers 0-1 of 2": {"attention": "splash", "experts": (
                "ragged (jax.lax.ragged_dot), experts split 4 ways over data (all_to_all)")}}}


_LM_REPORT = []


def _lm_report():
  """The lm job compiled for tpu:v5e-4, once per module: the same program is the lm case of the
  tiny jobs, the unrolled model of the trip-count test and the step the CLI test plans."""
  if not _LM_REPORT:
    _LM_REPORT.append(compile_on(TINY_JOBS["lm"](), *_devices("tpu:v5e-4")))
  return _LM_REPORT[0]


@pytest.mark.parametrize("job", sorted(TINY_JOBS))
def test_tiny_jobs_compile_for_a_tpu_with_splash(job):
  """`auto` attention on a TPU target resolves to splash (the target's platform, not the host's
  'cpu'), and Mosaic lowers it: the kernels are in the compiled step. The report says what
  each layer of each model ran, and how the token losses ran."""
  target, devices = _devices("tpu:v5e-4")
  report = _lm_report() if job == "lm" else compile_on(TINY_JOBS[job](), target, devices)
  assert report["devices"] == 4 and report["mesh"] == "4x1"
  assert report["compiled"]["argument_size_in_bytes"] > 0
  assert report["peak_bytes_per_device"] > 0
  assert report["hlo_matmul_flops_per_device"] > 0
  # The compiled matmuls agree with the analytic model, splash's attention left out; the MoE
  # job's experts run partly in Mosaic's ragged-dot kernels: not judged.
  assert report["flops_check"]["within"] is (None if job == "moe" else True), report["flops_check"]
  splash = [k for k in report["kernels"] if k.startswith("mosaic:splash_mqa")]
  assert any("fwd" in k for k in splash) and any("dkv" in k for k in splash), report["kernels"]
  assert any(choice.startswith("splash (") for choice in report["attention"]), report
  assert report["peak_bytes_per_device"] <= report["memory_bytes_per_device"]
  assert report["by_layer"] == BY_LAYER[job], report["by_layer"]
  (loss, n), = report["loss"].items()  # the student's token losses: one traced call
  # train.loss_impl='auto': the vocabulary slices (framework/vocab_slices.py), one slice here,
  # for every job's losses and output layer (LoRA's and QAT's too, the on-policy scoring's),
  # but a live teacher's KD, which takes the chunk engine on a TPU (distill/tpu_chunks.py)
  want = "chunked (vocabulary-chunk engine, 1 chunk(s)" if job == "distill" else \
      "sliced (vocabulary slices: 1 of "
  assert loss.startswith(want), loss
  assert not any("cross_entropy" in k for k in report["kernels"]), report["kernels"]
  if job == "moe":  # the experts' grouped matmuls lower to Mosaic's ragged-dot kernels
    assert any(k.startswith("mosaic:ragged-dot") for k in report["kernels"]), report["kernels"]
    assert report["moe"] == {"ragged (jax.lax.ragged_dot), experts split 4 ways over data "
                             "(all_to_all)": 2}, report["moe"]  # two layers, unrolled
    assert report["collectives"]["all-to-all"]["count"] > 0
  else:
    assert report["moe"] == {}, report["moe"]


@pytest.mark.parametrize("target_name", ["tpu:v5p-8", "tpu:v6e-4"])
def test_splash_lowers_on_v5p_and_v6e(target_name):
  c = _tiny(lm)
  c.model.attention_impl = "splash"
  report = compile_on(c, *_devices(target_name))
  assert "mosaic:splash_mqa_fwd_segmented_residuals" in report["kernels"], report["kernels"]


def test_cli_tpu_target_prints_the_compilers_figures(capsys, monkeypatch):
  """The plan's lines from the TPU compiler's figures. The command line's config is the lm tiny
  job's (asserted field by field), so its compile is the module's one of that job."""
  import distillax.plan.target as plan_target

  def compile_once(config, target, devices, model_overrides=None):
    assert config.to_dict() == TINY_JOBS["lm"]().to_dict()
    assert (target.name, len(devices)) == ("tpu:v5e-4", 4)
    return _lm_report()

  monkeypatch.setattr(plan_target, "compile_on", compile_once)
  code = main(["distillax", "plan", "--config", LM_TINY, "--target", "tpu:v5e-4",
               f"--config.train.seq_len={SEQ}", "--config.model.dtype=bfloat16"])
  out = capsys.readouterr().out
  assert code == 0, out
  assert "target tpu:v5e-4: 4 v5e devices (v5e:2x2), 16.0 GiB each" in out
  assert "plan: 4 devices, mesh 4x1" in out  # the mesh's devices, not the host's one
  assert "mosaic:splash_mqa_fwd" in out and "FITS in 16.00 GiB (v5e) per device" in out
  assert "\n  layers 0-1 of 2: attention splash\n" in out
  assert "\n  token loss: sliced (vocabulary slices: " in out
  # The TPU compiler's FSDP gradient reduction is an all-reduce-scatter fusion: a reduce-scatter.
  assert "reduce-scatter x" in out


def test_a_step_the_tpu_compiler_cannot_fit_is_reported_not_raised(capsys):
  """Activations of 2^18 x 128 tokens exceed a v5e's 16 GiB: libtpu refuses the compile
  (RESOURCE_EXHAUSTED); plan prints DOES NOT FIT with the compiler's line and exits 3, after
  the figures that need no compile (issue 55: it printed the compiler's line alone)."""
  code = main(["distillax", "plan", "--config", LM_TINY, "--target", "tpu:v5e-4",
               f"--config.train.seq_len={SEQ}", "--config.train.batch_size=262144"])
  out = capsys.readouterr().out
  assert code == DOES_NOT_FIT_EXIT_CODE == 3, out
  assert "DOES NOT FIT: the TPU compiler ran out of memory" in out and "HBM" in out
  lines = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
  for figure in ("vocabulary", "parameters", "optimizer", "checkpoint", "KV", "model"):
    assert figure in lines, out
  assert "plan: 4 devices, mesh 4x1" in out and "model FLOPs per step" in out


def test_search_finds_a_batch_and_remat_that_compile_and_fit(monkeypatch):
  """A 10 MiB budget on v5e-4 (tiny lm, 128 tokens): from the config's 2 sequences per device
  the search doubles the batch with remat=full until a compile does not fit, then tries cheaper
  policies at the largest batch that did. What it returns compiles again and fits; twice its
  batch did not. A trial of the lm job's own batch and remat is the module's compile of that
  job (_lm_report: the same config for the same target, so the same program)."""
  import distillax.plan.target as plan_target
  target, devices = _devices("tpu:v5e-4")
  budget = 10 * 2**20
  compiled = []  # (config, report) of every compile of the search
  lm_job = TINY_JOBS["lm"]().to_dict()

  def compile_on_recorded(config, *args, **kwargs):
    config = config.copy_and_resolve_references()
    same = (config.to_dict() == lm_job and not kwargs
            and (args[0].name, len(args[1])) == ("tpu:v5e-4", 4))
    compiled.append((config, _lm_report() if same else compile_on(config, *args, **kwargs)))
    return compiled[-1][1]

  monkeypatch.setattr(plan_target, "compile_on", compile_on_recorded)
  found = search_fit(_tiny(lm), target, devices, budget, max_per_device=4)
  assert found["batch"] is not None and found["remat"] in (
      "none", "save_dots", "save_dots_no_batch", "save_attention_mlp", "save_attention_qkv",
      "save_attention_up", "save_attention", "full")
  # The config it returns is _tiny(lm) with the batch and remat found, and the compiler's own
  # report of that config's compile (the search compiled it: no second compile) fits.
  again = _tiny(lm)
  again.train.batch_size, again.model.remat = found["batch"], found["remat"]
  (report,) = [r for c, r in compiled if c.to_dict() == again.to_dict()]
  assert "out_of_memory" not in report and report["peak_bytes_per_device"] <= budget
  doubled = [t for t in found["trials"] if t["batch"] == 2 * found["batch"]]
  assert found["per_device_batch"] == 4 or (doubled and not doubled[0]["fits"])


@pytest.mark.parametrize("start, limit, expected", [
    # (config's per-device batch, largest per-device batch that fits but with remat=none,
    #  (per-device batch found, remat found, compiles)); remat=none fits half of it.
    (2, 8, (8, "save_dots", 4 + 2)),  # full: 2, 4, 8 fit, 16 not; at 8 none fails, save_dots fits
    (8, 2, (2, "save_dots", 3 + 2)),  # 8 does not fit: halve to 4, then 2
    (4, 4, (4, "save_dots", 2 + 2)),
])
def test_search_doubles_from_the_configs_batch_then_halves(monkeypatch, start, limit, expected):
  """The search's walk, with a stand-in for the compile on 4 data-parallel devices: every
  policy but remat=none fits up to `limit` sequences per device, none up to half of it."""
  import distillax.plan.target as plan_target

  def trial(config, target, devices, budget, batch, remat):
    per = batch // 4
    return {"fits": per <= (limit // 2 if remat == "none" else limit), "peak": float(per),
            "batch": batch, "remat": remat}

  monkeypatch.setattr(plan_target, "_trial", trial)
  c = lm.get_config("tiny")
  c.train.batch_size = start * 4
  found = search_fit(c, None, [None] * 4, 1.0)
  assert (found["per_device_batch"], found["remat"], len(found["trials"])) == expected


def test_tpu_trip_counts_match_the_unrolled_program():
  """A scanned layer stack on TPU: its while loops carry no known_trip_count, so the counts
  come from the loops' conditions; the matmul FLOPs then equal those of the same model with
  its layers unrolled, where every layer is in the HLO (XLA's own figure counts the body once)."""
  target, devices = _devices("tpu:v5e-4")
  flops, unknown = {}, {}
  assert TINY_JOBS["lm"]().model.scan_layers is False  # the lm job's layers are unrolled
  for scan in (True, False):
    c = _tiny(lm)
    c.model.scan_layers = scan
    # `auto` is splash here (asserted); unrolled, the step is the lm job's: compiled once
    report = compile_on(c, target, devices) if scan else _lm_report()
    assert list(report["attention"]) and all(
        choice.startswith("splash (") for choice in report["attention"]), report["attention"]
    flops[scan] = report["hlo_matmul_flops_per_device"]
    unknown[scan] = report["collectives"]["trip_count_unknown"]
  assert unknown == {True: False, False: False}
  assert flops[True] == pytest.approx(flops[False], rel=0.02)


def test_cpu_plan_collectives_of_a_scanned_model_survive_losing_known_trip_count(monkeypatch):
  """The CPU plan's collective counts of a scanned model (XLA:CPU records known_trip_count)
  equal those read from the same HLO with the trip counts deleted, as a TPU compile gives it.
  The step is compiled as a user's XLA:CPU compiles it (tests/support/xla.py)."""
  import re
  compile_steps_with_default_cpu_emitters(monkeypatch)

  from distillax.plan.local import plan_report
  from distillax.trainers import recipe_for
  c = lm.get_config("tiny")
  c.model.scan_layers = True
  c.train.accum_steps, c.train.batch_size = 2, 16
  recipe = recipe_for(c)
  engine = recipe.build_engines().main
  text = engine.runner.compiled_text()
  assert "known_trip_count" in text
  stripped = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", text)
  plan = plan_report(recipe, engine)["collectives"]
  read = hlo.collective_stats(stripped)
  assert not read["trip_count_unknown"]
  for kind in hlo.COLLECTIVES:
    assert read[kind]["count"] == plan[kind]["count"], kind
    assert read[kind]["bytes"] == plan[kind]["bytes"], kind
  assert plan["all-gather"]["count"] > 0


def test_gpu_target_compiles_tiny_with_tokamax_kernels():
  """The CUDA plugin's deviceless compile for one H100: memory figures and the GPU compiler's
  own Triton fusions in the compiled step; attention_impl=tokamax, whose Mosaic GPU flash
  attention lowers (sm90, read from the target's device, not the host's CPU) to mosaic_gpu
  calls, three per layer (forward and its two backward kernels); 4 experts on
  moe_impl=tokamax, whose Triton ragged_dot kernels lower as Pallas Triton calls (3 grouped
  matmuls forward, 6 backward, per layer). One compile for the two (the suite's time budget):
  blockwise attention, pure JAX, is checked against the reference on CPU and compiled for TPU
  targets. Runs in a subprocess: the plugin is found at JAX's import (make test installs it in
  <venv>/aot-gpu, off the default path)."""
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  out = subprocess.run(
      [sys.executable, "-m", "distillax", "plan", "--config", LM_TINY, "--target", "gpu:h100x1",
       "--config.model.attention_impl=tokamax", "--config.model.dtype=bfloat16",
       "--config.model.num_experts=4", "--config.model.moe_impl=tokamax"],
      env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  text = out.stdout
  assert "target gpu:h100x1: 1 h100 devices (1x1x1)" in text
  assert "attention: tokamax (as configured: Mosaic GPU flash attention), 2 traced call(s)" in text
  assert "mosaic_gpu_v2 x6" in text, text  # tokamax's attention: 2 layers x 3
  assert "__triton" in text and "FITS in 74.51 GiB (h100) per device" in text
  assert "__gpu$xla.gpu.triton x18" in text, text  # tokamax's kernels: 2 layers x 9
  assert ("experts: tokamax (on gpu: the first of triton, xla that takes the call), experts not "
          "split (one GSPMD program), 2 traced call(s)") in text
  assert ("\n  layers 0-1 of 2: attention tokamax; experts tokamax (on gpu: the first of "
          "triton, xla that takes the call), experts not split (one GSPMD program)\n") in text
  peak = next(line for line in text.splitlines() if "peak per device" in line)
  assert not peak.strip().endswith(" 0 B"), peak


def test_gpu_target_without_cudnn_says_so_in_one_line():
  """`auto` attention in bf16 is cuDNN on a GPU target, whose lowering needs NVIDIA's cuDNN
  wheel (not installed by make test): one line naming the wheel and the blockwise fallback."""
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  out = subprocess.run(
      [sys.executable, "-m", "distillax", "plan", "--config", LM_TINY, "--target", "gpu:h100x1",
       "--config.model.dtype=bfloat16"], env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
  (line,) = [l for l in out.stderr.splitlines() if l.startswith("distillax plan: error:")]
  assert "attention runs cuDNN (model.attention_impl='auto'" in line
  assert "pip install nvidia-cudnn-cu12" in line and "attention_impl=blockwise" in line


def test_gpu_target_plans_a_distillation_with_both_models_attention_set():
  """A bf16 teacher on `auto` is cuDNN on a GPU target; model.attention_impl=blockwise used to
  leave the teacher asking for cuDNN (an error without NVIDIA's wheel). Now the teacher follows
  the student: every traced attention call, both models' layers, is blockwise."""
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  out = subprocess.run(
      [sys.executable, "-m", "distillax", "plan", "--config",
       f"{ROOT}/distillax/configs/distill.py:tiny", "--target", "gpu:h100x1",
       "--config.model.dtype=bfloat16", "--config.teacher.dtype=bfloat16",
       "--config.model.attention_impl=blockwise"],
      env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  text = out.stdout
  choices = [line for line in text.splitlines() if line.startswith("  attention: ")]
  # One traced call for the student's layer, two for the teacher's.
  assert choices == ["  attention: blockwise (as configured), 3 traced call(s)"], choices
  assert "\n  layer 0 of 1: attention blockwise\n" in text  # the student
  assert "\n  layers 0-1 of 2: attention blockwise\n" in text  # the teacher
  assert "cudnn" not in text.lower()
  assert "\n  compiling the step for gpu:h100x1 with the GPU compiler (a line every 30 s" in text
  # The GPU compiler gives no FLOPs figure of its own: said in words, in the plan and the log.
  assert "XLA gives no count of its own for this target" in text
  assert "no FLOPs figure from this compiler" in out.stderr
  assert "nan" not in text and "nan FLOPs" not in out.stderr


def test_a_target_compile_says_it_is_compiling_until_it_is_done():
  """A 2-minute target compile printed nothing: now a line at its start and one per interval
  (here 10 ms) while the block runs, and none once it has returned."""
  from distillax.plan import target as plan_target
  lines, ticked = [], threading.Event()

  def say(line):
    lines.append(line)
    if len(lines) >= 3:
      ticked.set()

  what = "tpu:v5e-4 with the TPU compiler"
  with plan_target.compile_progress(what, every_s=0.01, say=say):
    assert ticked.wait(60), lines  # the "compile" lasts until two ticks were said
  said = list(lines)
  assert said[0] == (f"  compiling the step for {what} (a line every 0.01 s until it is "
                     f"done)")
  assert len(said) >= 3 and all(re.fullmatch(rf"  still compiling for {what}: \d+ s", line)
                                for line in said[1:]), said
  assert not [t for t in threading.enumerate() if t.name == "compile-progress"]
  assert lines == said  # the ticker has stopped


def test_target_without_its_compiler_names_the_extra(monkeypatch, capsys):
  monkeypatch.setattr(targets, "installed", lambda module: False)
  code = main(["distillax", "plan", "--config", LM_TINY, "--target", "tpu:v5e-4"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2
  assert err[-1] == ("distillax plan: error: --target=tpu:v5e-4 compiles with libtpu (the TPU "
                     "compiler), which is not installed; install the 'aot' extra: pip install "
                     "'distillax[aot]'")


@pytest.mark.parametrize("argv, line", [
    (["--target", "tpu:v9-4"], "--target=tpu:v9-4: no TPU generation 'v9'"),
    (["--target", "tpu:v5p-12"], "--target=tpu:v5p-12: 12 TensorCores, 2 per chip is not a "
                                 "slice of v5p"),
    (["--target", "h100"], "--target=h100 is not a target"),
    (["--target", "gpu:h100x8", "--slices", "2"], "--slices is for TPU targets"),
    (["--search"], "--slices, --nodes and --search size a --target"),
    (["--target", "tpu:v5e-4", "--devices", "8"], "--devices=8 simulates CPU devices"),
    (["--target", "tpu:v5e-4", "--memory_gb", "0"], "--memory_gb=0 must be a positive number"),
])
def test_bad_target_lines(argv, line, capsys):
  code = main(["distillax", "plan", "--config", LM_TINY] + argv)
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and line in err[0], err


def test_target_names_and_shapes():
  """Names count as gcloud does: TensorCores for v4/v5p/tpu7x (2 per chip), chips for v5e/v6e;
  JAX sees one device per chip except on tpu7x (one per core)."""
  got = {name: (t.devices, t.topology, t.memory_bytes // 2**30) for name in
         ("tpu:v5e-256", "tpu:v5p-128", "tpu:v6e-64", "tpu:v4-32", "tpu:tpu7x-16")
         for t in [targets.parse_target(name)]}
  assert got == {"tpu:v5e-256": (256, "v5e:16x16", 16), "tpu:v5p-128": (64, "v5p:4x4x4", 95),
                 "tpu:v6e-64": (64, "v6e:8x8", 32), "tpu:v4-32": (16, "v4:2x2x4", 32),
                 "tpu:tpu7x-16": (16, "tpu7x:2x2x2", 96)}
  two = targets.parse_target("tpu:v5p-8", slices=2)
  assert (two.devices, two.slices) == (8, 2)
  gpus = targets.parse_target("gpu:h200x8", nodes=4)
  assert (gpus.devices, gpus.topology) == (32, "1x4x8")


def test_slices_smaller_than_a_host_and_v4_megacore_have_their_devices():
  """One v5e chip, two v5p chips (one device each) and a v4-8 (4 megacore chips)."""
  got = {name: len(targets.target_devices(targets.parse_target(name)))
         for name in ("tpu:v5e-1", "tpu:v5p-4", "tpu:v4-8")}
  assert got == {"tpu:v5e-1": 1, "tpu:v5p-4": 2, "tpu:v4-8": 4}
