"""The pieces of benchmarks/tpu_levers.py: the model pairs, timed model creation, one variant of
the train, KD or on-policy step (lowered, then compiled apart so several compile at once), and
the session that runs the variants on one state. The on-policy step's own pieces (its sampler
timed apart, the decode roofline) are benchmarks/lib/on_policy_lever.py."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from benchmarks.lib import common, draft_lever, on_policy_lever
from benchmarks.lib.accelerator_measure import teacher_twice
from distillax import partitioning as pt
from distillax.configs import lora as lora_config
from distillax.configs import qlora
from distillax.distill import LogitKD, make_distill_objective
from distillax.framework import backends, build_engine, flops, throughput, vocab_stats_kernel
from distillax.framework.vocab_chunks import AUTO
from distillax.models import abstract_model, get_preset, param_count
from distillax.models.config import COMPUTE, TransformerConfig, fields_of_kind
from distillax.models.init import init_program
from distillax.quant import lora_matmul, q8_0_kernel, quantize_for_training
from distillax.quant.int8_model import abstract_int8_model, int8_model
from distillax.trainers import lm_objective
from distillax.trainers.transforms import StudentTransforms


def _real(tiny: bool) -> dict:
  """The pair users distil on one chip: Qwen3-1.7B -> Qwen3-0.6B, vocabulary 151,936, the
  student with fp32 master weights and bf16 compute, the teacher frozen in bf16."""
  if tiny:
    return {"student": get_preset("tiny", param_dtype="float32", dtype="float32"),
            "teacher": get_preset("tiny", num_layers=4, embed_dim=96, num_heads=6,
                                  num_kv_heads=2, mlp_dim=192)}
  return {"student": get_preset("qwen3-0.6b", param_dtype="float32", dtype="bfloat16"),
          "teacher": get_preset("qwen3-1.7b", param_dtype="bfloat16", dtype="bfloat16")}


def _continuity(tiny: bool) -> dict:
  """The pair of the first chip figures: a 383M Llama-3.2-shaped student (width 1024) and a
  teacher of the same shape with twice its parameters (40 layers, 761M)."""
  if tiny:
    return _real(True)
  student = get_preset("llama3.2-1b", embed_dim=1024, mlp_dim=4096, num_heads=16,
                       param_dtype="float32", dtype="bfloat16")
  return {"student": student,
          "teacher": teacher_twice(student).replace(param_dtype="bfloat16")}


def _moe(tiny: bool) -> dict:
  """A Qwen3-MoE-shaped teacher that fits one chip with the real student: 8 layers of 16
  experts (top-4, width 768) at width 2048, 1.38B parameters in bf16, into Qwen3-0.6B."""
  if tiny:
    return {"student": _real(True)["student"],
            "teacher": get_preset("tiny_moe", vocab_size=256, router="softmax_topk")}
  return {"student": _real(False)["student"],
          "teacher": get_preset("qwen3-30b-a3b", num_layers=8, num_experts=16,
                                num_experts_per_tok=4, param_dtype="bfloat16")}


def _moe_student(tiny: bool) -> dict:
  """A Qwen3-MoE-shaped student trained on one chip: 8 layers of 16 experts (top-4, width 768)
  at width 1024, tied embeddings, 0.50B parameters with fp32 master weights (a 1.0B one at width
  2048 needs 12 GB of weights and Adam state alone: 17.9 GB compiled at 2 x 2048). The teacher
  is the real pair's, for KD rows."""
  if tiny:
    return {"student": get_preset("tiny_moe", param_dtype="float32"),
            "teacher": _real(True)["teacher"]}
  return {"student": get_preset("qwen3-30b-a3b", embed_dim=1024, num_layers=8, num_heads=16,
                                num_kv_heads=4, num_experts=16, num_experts_per_tok=4,
                                moe_mlp_dim=768, tie_embeddings=True, param_dtype="float32",
                                dtype="bfloat16"),
          "teacher": _real(False)["teacher"]}


PAIRS = {"real": _real, "continuity": _continuity, "moe": _moe, "moe_student": _moe_student}


def pair_configs(name: str, tiny: bool = False) -> dict:
  return PAIRS[name](tiny)


def one_chip(device=None):
  """A (1, 1) mesh over `device` (default: the first of this host's) and the dp rules (one
  chip: nothing is split). benchmarks/compile_sizes.py passes a TPU target's compile-only
  device."""
  mesh = pt.create_mesh({"data": 1, "model": 1},
                        devices=[device] if device is not None else jax.devices()[:1])
  return mesh, pt.rules_from_config({"strategy": "dp"})


class ModelFactory:
  """A model's initialiser compiled once (timed: trace + lower, compile, first run), then run
  again for every state that needs fresh weights (a donated state takes its model's buffers).
  The trainer's init program (models/init.init_program: least effort): compiled at the default
  effort, the two models' init had spent 17.8 s (student) and 22.1 s (teacher) of chip call 44."""

  def __init__(self, cfg, seed: int = 0):
    mesh, rules = one_chip()
    t0 = time.perf_counter()
    self.graphdef, self.abstract_state = nnx.split(abstract_model(cfg, seed))
    shardings = pt.tree_shardings(nnx.to_pure_dict(self.abstract_state),
                                  pt.logical_tree(self.abstract_state), mesh, rules)

    lowered = init_program(shardings).lower(cfg, seed)
    t1 = time.perf_counter()
    self.exe = functools.partial(lowered.compile(), seed)  # the seed is its one argument
    t2 = time.perf_counter()
    jax.block_until_ready(self.exe())
    t3 = time.perf_counter()
    self.timing = {"params": param_count(cfg), "trace_lower_s": t1 - t0, "compile_s": t2 - t1,
                   "run_s": t3 - t2, "total_s": t3 - t0}

  def make(self):
    state = jax.tree.map(lambda x: x, self.abstract_state)
    nnx.replace_by_pure_dict(state, self.exe())
    return nnx.merge(self.graphdef, state)


KINDS = ("train", "kd", on_policy_lever.KIND, draft_lever.KIND)


@dataclasses.dataclass(frozen=True)
class Variant:
  kind: str  # one of KINDS
  remat: str
  batch: int
  seq_len: int
  # Student model fields, or loss_impl / chunk, or the teacher's: teacher_remat, teacher_scan,
  # teacher_int8=True (its matmul weights int8 codes + scales, its matmuls int8: the
  # teacher.int8 of a distill job, quant/int8_model.py); lora=qlora (the student as
  # configs/qlora.py adapts it), lora_dropout=P (its adapters' dropout instead of the
  # config's), lora_bwd=two (dx of their frozen base and of the adapter apart, not through
  # W + s A B: quant/lora_matmul.BACKWARD_MERGED); on_policy's new_tokens, micro and
  # kv_int8=True (its sampler's KV cache in int8; on_policy_lever.py);
  # opt_state_dtype=bfloat16 (optimizer.state_dtype: Adam's moments in bf16);
  # q8_0_kernel=NAME (QAT's q8_0 activation kernel on a TPU: quant/q8_0_kernel.KERNEL);
  # compile_effort=E (XLA's exec_time_optimization_effort for the step, -1..1: what a cheaper
  # compile costs the step's speed); stats_kernel=xla|auto (the sliced loss's forward
  # statistics: the XLA pass over the slices, or the Pallas kernel on a TPU,
  # framework/vocab_stats_kernel.KERNEL), stats_tiles=ROWSxCOLUMNS (that kernel's tiles).
  options: tuple[tuple[str, str], ...] = ()

  @classmethod
  def parse(cls, text: str, seq_len: int, splash_best: str = "") -> "Variant":
    """`kind:remat:batch[:key=value...]`; `splash=best` stands for `splash_best` (the fastest
    tiles benchmarks/splash_blocks.py measured, as its options)."""
    text = text.replace(":splash=best", f":{splash_best}" if splash_best else "")
    kind, remat, batch, *rest = text.split(":")
    if kind not in KINDS:
      raise ValueError(f"variant {text!r}: kind must be one of {', '.join(KINDS)}")
    opts = tuple(tuple(r.split("=", 1)) for r in rest)
    seq = dict(opts).get("seq_len")
    return cls(kind, remat, int(batch), int(seq) if seq else seq_len,
               tuple((k, v) for k, v in opts if k != "seq_len"))

  @property
  def name(self) -> str:
    rest = "".join(f":{k}={v}" for k, v in self.options)
    return f"{self.kind}:{self.remat}:{self.batch}x{self.seq_len}{rest}"

  @property
  def safe_name(self) -> str:
    return "".join(c if c.isalnum() else "_" for c in self.name)

  def summary(self) -> dict:
    return {"kind": self.kind, "remat": self.remat, "batch": self.batch,
            "seq_len": self.seq_len, "options": dict(self.options)}

  def model_fields(self) -> dict[str, Any]:
    special = ("loss_impl", "chunk", "teacher_remat", "teacher_scan", "teacher_moe_impl", "pair",
               "qat", "teacher_int8", "lora", "lora_dropout", "new_tokens", "micro",
               "opt_state_dtype", "kv_int8", "ttt", "draft_vocab", "lora_bwd",
               "q8_0_kernel", "compile_effort", "stats_kernel", "stats_tiles")
    out = {"remat": self.remat}
    for k, v in self.options:
      if k not in special:
        out[k] = _value(v)
    return out

  def option(self, key: str, default=None):
    return dict(self.options).get(key, default)


def _value(text: str):
  if "/" in text:  # a tuple of ints: splash_blocks=512/1024/512
    return tuple(int(x) for x in text.split("/"))
  for cast in (int, float):
    try:
      return cast(text)
    except ValueError:
      pass
  return {"True": True, "False": False, "None": None}.get(text, text)


@dataclasses.dataclass
class Lowered:
  variant: Variant
  engine: Any
  lowered: Any
  student_cfg: Any
  teacher_cfg: Any
  teacher_int8: bool = False
  tiny: bool = False
  sampler: Any = None  # on_policy: the trainer's sampling-only program, lowered
  sampler_exe: Any = None  # ... and compiled (compile_timed)
  head_cfg: Any = None  # draft: the EAGLE-3 head's config (draft_lever.py)


def objective_for(v: Variant, vocab: int):
  if v.kind == draft_lever.KIND:
    return draft_lever.objective(v)
  if v.kind == on_policy_lever.KIND:
    return on_policy_lever.objective(v, vocab)
  if v.kind == "train":
    loss_impl, chunk = v.option("loss_impl", "chunked"), v.option("chunk")
    return functools.partial(lm_objective, loss_impl=loss_impl,
                             chunk_size=int(chunk) if chunk else AUTO)
  chunk = v.option("chunk")
  return make_distill_objective(LogitKD(temperature=2.0, alpha=0.7),
                                chunk_size=int(chunk) if chunk else AUTO, metrics=False,
                                sliced=v.option("loss_impl") == "sliced")


def lower(v: Variant, pair: dict, tiny: bool = False, device=None) -> Lowered:
  """The variant's step built by `build_engine` (the trainer's), traced and lowered only; an
  on-policy variant's sampling-only program too. `tiny`: the pair is the tiny one (QLoRA takes
  configs/qlora.py:tiny's tiles); `device`: the chip it is lowered for (one_chip)."""
  student_cfg = pair["student"].replace(**v.model_fields())
  head_cfg = None
  if v.kind == draft_lever.KIND:  # the head over the teacher; ids drawn from its vocabulary
    student_cfg = pair["teacher"]
    head_cfg = draft_lever.head_config(v, pair["teacher"], tiny)
  teacher_cfg = None
  if v.kind in ("kd", on_policy_lever.KIND, draft_lever.KIND):
    teacher_fields = {}
    if v.option("teacher_remat"):
      teacher_fields["remat"] = v.option("teacher_remat")
    if v.option("teacher_scan"):
      teacher_fields["scan_layers"] = _value(v.option("teacher_scan"))
    if v.option("teacher_moe_impl"):
      teacher_fields["moe_impl"] = v.option("teacher_moe_impl")
    teacher_cfg = pair["teacher"].replace(**teacher_fields)
  teacher_int8 = teacher_cfg is not None and _value(v.option("teacher_int8", "False")) is True
  mesh, rules = one_chip(device)
  extras = {}
  if teacher_cfg is not None:
    teacher = abstract_model(teacher_cfg)
    extras["teacher"] = abstract_int8_model(teacher) if teacher_int8 else teacher
  if head_cfg is not None:
    student = draft_lever.abstract_head(head_cfg)
  else:
    abstract_student = abstract_model(student_cfg)
    student = nnx.eval_shape(lambda: transformed(v, abstract_student, tiny))
  lora = lora_transforms(v, tiny)
  shapes = (on_policy_lever.batch_shapes(v) if v.kind == on_policy_lever.KIND
            else common.batch_shapes(v.batch, v.seq_len))
  objective = lora.train_objective(objective_for(v, student_cfg.vocab_size))
  accum = on_policy_lever.accum_steps(v) if v.kind == on_policy_lever.KIND else 1
  optimizer = common.benchmark_optimizer()
  optimizer.state_dtype = v.option("opt_state_dtype", optimizer.state_dtype)
  engine = build_engine(student, extras, objective, optimizer, 1000, mesh, rules, "jit", shapes,
                        accum_steps=accum, trainable=lora.trainable(), compile_now=False)
  abstract_batch = {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=backends.batch_sharding(
      mesh, rules, len(s.shape), s.shape)) for k, s in shapes.items()}
  abstract_state = backends.sharded_abstract_state(engine.layout)
  merged, kernel = lora_matmul.BACKWARD_MERGED, q8_0_kernel.KERNEL
  stats = (vocab_stats_kernel.KERNEL, vocab_stats_kernel.TILE_ROWS,
           vocab_stats_kernel.TILE_COLUMNS)
  lora_matmul.BACKWARD_MERGED = v.option("lora_bwd", "one") == "one"
  q8_0_kernel.KERNEL = v.option("q8_0_kernel", kernel)
  vocab_stats_kernel.KERNEL = v.option("stats_kernel", stats[0])
  if v.option("stats_tiles"):
    vocab_stats_kernel.TILE_ROWS, vocab_stats_kernel.TILE_COLUMNS = (
        int(t) for t in v.option("stats_tiles").split("x"))
  swapped = q8_0_kernel.KERNEL != kernel
  if swapped:  # the activations' custom VJP keeps its traced kernel in JAX's caches
    jax.clear_caches()
  try:
    lowered = engine.runner.call.lower(abstract_state, abstract_batch)
  finally:
    lora_matmul.BACKWARD_MERGED, q8_0_kernel.KERNEL = merged, kernel
    (vocab_stats_kernel.KERNEL, vocab_stats_kernel.TILE_ROWS,
     vocab_stats_kernel.TILE_COLUMNS) = stats
    if swapped:
      jax.clear_caches()
  sampler = (on_policy_lever.lower_sampler(engine, v, student_cfg.vocab_size, abstract_state,
                                           abstract_batch)
             if v.kind == on_policy_lever.KIND else None)
  return Lowered(v, engine, lowered, student_cfg, teacher_cfg, teacher_int8, tiny, sampler,
                 head_cfg=head_cfg)


# qat=q4_0: llama.cpp's q4_0 weights and q8_0 activations everywhere but the output layer (the
# top module, path ''), as the demo and README train for llama.cpp.
# qat=int8: int8 weights per channel and activations per token, multiplied as int8 codes
# (qat.int8_matmul), the output layer kept as it is; qat=int8_backward: the backward's
# matmuls in int8 too (qat.int8_backward).
QAT_RULES = {"q4_0": {"rules": [("", None, None, None), (".*", "q4_0", "q8_0", None)]},
             "q4_0_weights": {"rules": [("", None, None, None), (".*", "q4_0", None, None)]},
             "int8": {"rules": [("", None, None, None), (".*", "int8", "int8", None)],
                      "int8_matmul": True},
             "int8_backward": {"rules": [("", None, None, None), (".*", "int8", "int8", None)],
                               "int8_matmul": True, "int8_backward": True}}
# lora=qlora: the adapters, nf4 base and tiles of configs/qlora.py (its :tiny tiles for the tiny
# pair, whose head_dim is 16); lora=lora: configs/lora.py's adapters over the full-precision base.
LORA_CONFIGS = {"qlora": qlora.get_config, "lora": lora_config.get_config}


def lora_transforms(v: Variant, tiny: bool) -> StudentTransforms:
  """The job's LoRA transforms (adapters, the trainable filter, adapter dropout) for a variant
  with lora=NAME; none (every parameter trains) otherwise."""
  name = v.option("lora")
  if not name:
    return StudentTransforms()
  config = LORA_CONFIGS[name]("tiny" if tiny else None)
  if v.option("lora_dropout") is not None:  # lora_dropout=P: in place of the config's
    config.lora.dropout = float(v.option("lora_dropout"))
  return StudentTransforms(lora=config.lora, seed=int(config.seed))


def transformed(v: Variant, student, tiny: bool = False):
  """The student as the variant trains it: adapted (LoRA/QLoRA) or fake-quantized (QAT) when it
  says so."""
  student = lora_transforms(v, tiny).apply(student)
  if v.option("qat"):
    return quantize_for_training(student, QAT_RULES[v.option("qat")])
  return student


def compile_timed(low: Lowered):
  """The step compiled (timed), and an on-policy variant's sampling program with it."""
  effort = low.variant.option("compile_effort")
  options = {"exec_time_optimization_effort": float(effort)} if effort is not None else None
  t0 = time.perf_counter()
  exe = low.lowered.compile(compiler_options=options)
  seconds = time.perf_counter() - t0
  if low.sampler is not None:
    low.sampler_exe = low.sampler.compile()
  return low, exe, seconds


def compiled_peak(exe) -> int:
  return common.peak_bytes(backends.compiled_stats(exe))


def memory_stats() -> dict:
  try:
    return dict(jax.devices()[0].memory_stats() or {})
  except Exception:  # noqa: BLE001 - CPU has none
    return {}


def memory_limit() -> int | None:
  return memory_stats().get("bytes_limit")


def init_config(cfg):
  """`cfg` with its compute fields at their defaults: they decide how a model runs, never its
  initial weights, so every variant of one model shares one ModelFactory."""
  defaults = TransformerConfig()
  return cfg.replace(**{f: getattr(defaults, f) for f in fields_of_kind(COMPUTE) if f != "dtype"})


def layout_key(low: "Lowered") -> tuple:
  """What decides the state's arrays: variants with the same key share one state."""
  t = low.teacher_cfg
  return (low.variant.kind == draft_lever.KIND, low.variant.option("pair", ""),
          low.variant.option("qat", ""),
          low.variant.option("opt_state_dtype", "float32"),
          low.student_cfg.scan_layers, low.student_cfg.param_dtype,
          t.scan_layers if t is not None else None, low.teacher_int8)


def state_key(low: "Lowered") -> tuple:
  """layout_key and the student transforms that change the state's arrays besides QAT's
  (adapters and a quantized base): variants with the same key share one state."""
  return layout_key(low) + (low.variant.option("lora", ""),)


class Session:
  """One train state shared by the variants of a group with one layout (the same arrays
  whatever the remat, batch or attention kernel): each variant's compiled step takes the state
  the last one left. `factories(cfg)` gives the ModelFactory of a model config."""

  def __init__(self, factories, first: "Lowered"):
    base = init_config
    extras, self.teacher_int8_s = {}, None
    if first.teacher_cfg:
      extras["teacher"] = factories(base(first.teacher_cfg), "teacher").make()
      if first.teacher_int8:  # converted on the device, in one jit; the bf16 arrays are dropped
        t0 = time.perf_counter()
        extras["teacher"] = int8_model(extras["teacher"])
        jax.block_until_ready(nnx.state(extras["teacher"]))
        self.teacher_int8_s = time.perf_counter() - t0
    if first.head_cfg is not None:  # the EAGLE-3 head, started from the teacher's parts
      student = draft_lever.make_head(first.head_cfg, extras["teacher"])
    else:
      student = transformed(first.variant,
                            factories(base(first.student_cfg), "student").make(), first.tiny)
    self.state = first.engine.init_state(student, extras, 0)
    # What the optimizer updates: every student parameter, or the adapters alone (LoRA).
    self.trainable_params = sum(int(x.size) for x in jax.tree.leaves(self.state.params))
    self.peak_flops, _ = throughput.peak_flops_per_device()

  def time(self, low: Lowered, exe, steps: int) -> dict:
    v = low.variant
    if v.kind == on_policy_lever.KIND:  # sampling and the update timed apart
      return {**on_policy_lever.timed(self, low, exe, steps), "memory_stats": memory_stats(),
              "trainable_params": self.trainable_params}
    batch = low.engine.runner.place_batch(host_batch(low, seed=1))
    t0 = time.perf_counter()
    self.state, metrics = exe(self.state, batch)
    first_loss = float(metrics["loss"])
    warmup_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
      t0 = time.perf_counter()
      self.state, metrics = exe(self.state, batch)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    model_flops = (draft_lever.step_flops(v, low.head_cfg, low.teacher_cfg)
                   if low.head_cfg is not None else
                   flops.train_step_flops(low.student_cfg, v.batch, v.seq_len,
                                          low.teacher_cfg)["total"])
    return {"step_s": step_s, "step_s_all": times, "warmup_s": warmup_s,
            "tokens_per_s": v.batch * v.seq_len / step_s, "model_flops": model_flops,
            "tflops_per_s": model_flops / step_s / 1e12,
            "mfu_causal": throughput.mfu(model_flops, step_s, 1, self.peak_flops),
            "first_loss": first_loss, "final_loss": float(metrics["loss"]),
            "memory_stats": memory_stats(), "trainable_params": self.trainable_params,
            **({} if self.teacher_int8_s is None else {"teacher_int8_s": self.teacher_int8_s})}

  def profile(self, low: Lowered, exe, trace_dir) -> None:
    batch = low.engine.runner.place_batch(host_batch(low, seed=2))
    jax.profiler.start_trace(str(trace_dir))
    try:
      for _ in range(2):
        self.state, metrics = exe(self.state, batch)
      jax.block_until_ready(metrics)
    finally:
      jax.profiler.stop_trace()


def host_batch(low: Lowered, seed: int) -> dict:
  """A batch of the variant's shapes: packed documents, or an on-policy step's prompts."""
  v, vocab = low.variant, low.student_cfg.vocab_size
  if v.kind == on_policy_lever.KIND:
    return on_policy_lever.host_batch(v, vocab, seed)
  return common.packed_batch(v.batch, v.seq_len, vocab, seed=seed)


def best_splash(path: str, head_dim: int, seq_len: int) -> str:
  """The variant options of the fastest agreeing splash setting splash_blocks.json measured for
  this head dim and sequence length ('' when it has none)."""
  rows = [r for r in json.loads(open(path).read()).get("best", [])
          if r["shape"]["head_dim"] == head_dim and r["shape"]["L"] == seq_len]
  if not rows:
    return ""
  s = rows[0]["setting"]
  return (f"splash_blocks={s['block_q']}/{s['block_kv']}/{s['block_kv_compute']}:"
          f"splash_fused_bwd={s['fused_bwd']}")
