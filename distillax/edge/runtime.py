"""Running an exported GGUF in llama.cpp (llama-cpp-python, the `edge` extra) for measurements.

  llm = gguf_runtime.load("student-q4_0.gguf")
  logits_LxV = gguf_runtime.logits(llm, ids)       # llama.cpp's own forward, every position
  ids_out = gguf_runtime.greedy(llm, prompt, 32)   # its incremental decode (KV cache), argmax
  figures = gguf_runtime.measure_in_subprocess("student-q4_0.gguf", sequences=[...],
                                               speed={"prompt": ids, "decode": ids})

`measure_in_subprocess` runs llama.cpp in a child Python that imports numpy and llama_cpp only
(no JAX), so its peak RSS (that process's own high-water mark) is the runtime's, and returns
validation NLL sums, greedy continuations, prompt / decode tokens/s and memory.

Which kernels llama.cpp runs depends on the CPU, so every load names its kernel path:
  - "reference": llama.cpp's portable CPU kernels (one q8_0-rounded activation row against each
    weight row; "extra buffer types" off), whose rounding quant/ggml.py models. Forced on every
    CPU; the exactness judge (tests, the demo's "judge" rows) uses it.
  - "repack": llama.cpp's own default: its extra buffer types on, so q4_0 / q8_0 weights whose
    shapes allow it are repacked into interleaved blocks and multiplied by the AVX2 / AVX-512 /
    NEON GEMM kernels (REPACK in its system info). Their activation rounding and summation are
    not the portable kernels': measured on an AVX-512 CPU without AMX, q4_0 logits of a QAT
    export differ from the fake-quant forward by up to 0.033 (reference: 5e-7). Not available
    on AMX CPUs: there the extra buffer types include llama.cpp 0.3.36's AMX matmul, which
    crashes (SIGSEGV in ggml_backend_amx_mul_mat, upstream llama.cpp issue 20824).
`deployment_kernels()` is the path a deployment on this CPU gets (llama.cpp's defaults, AMX
aside); `kernel_paths()` every path this host can force.

The KV cache is float32 by default here (`exact_cache=True`; llama.cpp's default is float16),
so comparing logits with distillax's forward measures the weights' and activations' rounding,
not the cache's; pass exact_cache=False to measure the deployment default.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np

from distillax.errors import UserError

GGML_TYPE_F32 = 0


def _llama_cpp():
  try:
    import llama_cpp
  except ImportError as e:
    raise UserError("running a GGUF needs llama-cpp-python; install the edge extra: pip install "
                    "'distillax[edge]' (it builds llama.cpp from source)") from e
  return llama_cpp


KERNEL_PATHS = ("reference", "repack")


def system_info() -> str:
  """llama.cpp's own line naming the CPU features and kernel options it uses here."""
  return _llama_cpp().llama_print_system_info().decode("utf-8", "replace").strip()


def has_amx() -> bool:
  """Whether this llama.cpp build uses AMX matmuls on this CPU."""
  return "AMX_INT8 = 1" in system_info()


def kernel_paths() -> tuple[str, ...]:
  """The kernel paths this host can force (see the module docstring)."""
  repack = "REPACK = 1" in system_info() and not has_amx()
  return KERNEL_PATHS if repack else KERNEL_PATHS[:1]


def deployment_kernels() -> str:
  """The path llama.cpp takes by default on this CPU (with AMX, whose kernels crash in this
  build, turned off)."""
  return kernel_paths()[-1]


def _use_extra_bufts(kernels: str) -> bool:
  if kernels not in KERNEL_PATHS:
    raise UserError(f"kernels={kernels!r} is unknown; use one of {', '.join(KERNEL_PATHS)}")
  if kernels not in kernel_paths():
    raise UserError(f"kernels={kernels!r} cannot run on this CPU (llama.cpp: {system_info()}); "
                    f"use kernels='reference'")
  return kernels == "repack"


@contextlib.contextmanager
def _model_params(use_extra_bufts: bool):
  """llama_cpp.Llama builds its model params from llama_model_default_params() and offers no
  argument for use_extra_bufts, so the default is patched while a model loads."""
  low_level = _llama_cpp().llama.llama_cpp
  default = low_level.llama_model_default_params

  def params():
    p = default()
    p.use_extra_bufts = use_extra_bufts
    return p

  low_level.llama_model_default_params = params
  try:
    yield
  finally:
    low_level.llama_model_default_params = default


def load(path: str | os.PathLike, *, kernels: str = "reference", exact_cache: bool = True,
         n_ctx: int = 0, n_threads: int | None = None, all_logits: bool = True):
  """A llama_cpp.Llama for `path` on the `kernels` path that keeps every position's logits
  (all_logits=False: none, for timing decode as a deployment runs it). n_ctx 0: the file's
  context_length."""
  llama_cpp = _llama_cpp()
  if not os.path.isfile(path):
    raise UserError(f"{path}: no such GGUF file")
  cache = dict(type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32) if exact_cache else {}
  with _model_params(use_extra_bufts=_use_extra_bufts(kernels)):
    return llama_cpp.Llama(model_path=os.fspath(path), logits_all=all_logits, n_ctx=n_ctx,
                           n_threads=n_threads, n_threads_batch=n_threads, verbose=False,
                           **cache)


def logits(llm, ids: Sequence[int]) -> np.ndarray:
  """llama.cpp's float32 logits (len(ids), vocab) for `ids` evaluated from position 0."""
  llm.reset()
  llm.eval([int(i) for i in ids])
  return np.array(llm.scores[:len(ids)], dtype=np.float32)


def greedy(llm, prompt: Sequence[int], max_new_tokens: int,
           vocab_limit: int | None = None, stop_id: int | None = None) -> list[int]:
  """Greedy continuation in llama.cpp: the prompt once, then one token per decode step.
  vocab_limit: the tokenizer's size, as distillax's sampler takes it (the argmax over ids below
  it: a padded vocabulary's extra rows are never picked); None: llama.cpp's raw argmax.
  stop_id: decoding ends once it is picked (it is the last id returned)."""
  llm.reset()
  llm.eval([int(i) for i in prompt])
  out = []
  for _ in range(max_new_tokens):
    token = int(np.argmax(llm.scores[llm.n_tokens - 1][:vocab_limit]))
    out.append(token)
    if token == stop_id or len(out) == max_new_tokens:
      break
    llm.eval([token])
  return out


def tokenize(llm, text: str, add_bos: bool = False) -> list[int]:
  """llama.cpp's ids for `text` (special-token text is not parsed)."""
  return list(llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False))


def sequence_nll(llm, inputs: Sequence[int], targets: Sequence[int],
                 mask: Sequence[float], vocab_limit: int | None = None) -> float:
  """sum(mask * -log p(target)) over one sequence evaluated from position 0 in llama.cpp: the
  log-softmax in float64 of its float32 logits, as distillax's cross_entropy_sums weighs it.
  vocab_limit: the tokenizer's size: the softmax over the ids below it, as distillax's losses
  take theirs (a file padded with unused tokens to the model's rows); None: every row."""
  z = logits(llm, inputs).astype(np.float64)[:, :vocab_limit]
  z -= z.max(axis=-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
  picked = logp[np.arange(len(targets)), np.asarray(targets, np.int64)]
  return float(-(np.asarray(mask, np.float64) * picked).sum())


def time_prompt_and_decode(llm, prompt: Sequence[int], decode: Sequence[int],
                           rounds: int) -> dict[str, Any]:
  """Prompt processing (one batch of `prompt`) and decode (one llama.cpp decode per token of
  `decode`, after the prompt), timed `rounds` times after one untimed warm-up: tokens/s of the
  median round, and every round's seconds. Which tokens are decoded does not change the work,
  so the decode tokens are given, not sampled."""
  prompt_s, decode_s = [], []
  for r in range(rounds + 1):
    llm.reset()
    start = time.perf_counter()
    llm.eval([int(t) for t in prompt])
    middle = time.perf_counter()
    for t in decode:
      llm.eval([int(t)])
    end = time.perf_counter()
    if r:
      prompt_s.append(middle - start)
      decode_s.append(end - middle)
  return {"prompt_tokens_per_s": len(prompt) / statistics.median(prompt_s),
          "decode_tokens_per_s": len(decode) / statistics.median(decode_s),
          "prompt_s": prompt_s, "decode_s": decode_s, "prompt_tokens": len(prompt),
          "decode_tokens": len(decode)}


def _peak_rss_bytes() -> int:
  """This process's peak resident memory. On Linux, VmHWM of /proc/self/status: getrusage's
  ru_maxrss of a child also counts the parent's resident memory at fork (the kernel carries the
  pre-exec high-water mark over exec), so a child of a 1 GB JAX process would report >= 1 GB."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024  # kB
  except OSError:
    pass
  scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux / BSD KiB
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def child_main(spec_path: str, out_path: str) -> None:
  """The child's work (see `measure_in_subprocess`): quality with every logit kept, then speed
  with none kept, as a deployment decodes; peak RSS at the end covers both."""
  with open(spec_path) as f:
    spec = json.load(f)
  import llama_cpp  # noqa: F401  (counted in the baseline, before any model is loaded)
  out = {"rss_before_load_bytes": _peak_rss_bytes(), "n_threads": spec["n_threads"],
         "kernels": spec["kernels"], "exact_cache": spec["exact_cache"],
         "system_info": system_info()}
  opts = dict(n_threads=spec["n_threads"], exact_cache=spec["exact_cache"],
              kernels=spec["kernels"])
  if spec["sequences"] or spec["greedy_prompts"]:
    llm = load(spec["path"], **opts)
    try:
      out["nll"] = [sequence_nll(llm, *s, vocab_limit=spec.get("vocab_limit"))
                    for s in spec["sequences"]]
      out["greedy"] = [greedy(llm, p, spec["greedy_tokens"]) for p in spec["greedy_prompts"]]
    finally:
      llm.close()
  if spec["speed"]:
    llm = load(spec["path"], all_logits=False, **opts)
    try:
      out.update(time_prompt_and_decode(llm, spec["speed"]["prompt"], spec["speed"]["decode"],
                                        int(spec["speed"].get("rounds", 3))))
    finally:
      llm.close()
  out["peak_rss_bytes"] = _peak_rss_bytes()
  with open(out_path, "w") as f:
    json.dump(out, f)


# The child imports this file by path, not as `distillax.edge.runtime`: importing it through
# its packages would run their __init__ files, and anything they pulled in (JAX) would count in
# the runtime's memory.
_CHILD = ("import importlib.util, sys; s = importlib.util.spec_from_file_location("
          "'gguf_runtime_child', sys.argv[1]); m = importlib.util.module_from_spec(s); "
          "s.loader.exec_module(m); m.child_main(sys.argv[2], sys.argv[3])")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure_in_subprocess(path: str | os.PathLike, *, sequences: Sequence[Any] = (),
                          greedy_prompts: Sequence[Sequence[int]] = (), greedy_tokens: int = 32,
                          speed: dict[str, Any] | None = None, n_threads: int | None = None,
                          exact_cache: bool = True, kernels: str = "reference",
                          timeout_s: float = 1800, vocab_limit: int | None = None
                          ) -> dict[str, Any]:
  """llama.cpp's own figures for one GGUF file, from a fresh child process.

  sequences: (inputs, targets, loss mask) triples, each evaluated from position 0 -> "nll", their
  NLL sums (over the ids below `vocab_limit`, the tokenizer's, when given); greedy_prompts -> "greedy", `greedy_tokens` argmax tokens after each; speed:
  {"prompt": ids, "decode": ids, "rounds": n} -> prompt_tokens_per_s, decode_tokens_per_s (see
  `time_prompt_and_decode`). Always: peak_rss_bytes of the child (its own peak
  resident memory: llama.cpp's buffers and the mapped weights it touched) and
  rss_before_load_bytes (the interpreter, numpy and llama_cpp, before any model), and the
  kernel path, cache type and llama.cpp system info they were measured with.
  """
  if not os.path.isfile(path):
    raise UserError(f"{path}: no such GGUF file")
  spec = {"path": os.fspath(path), "greedy_tokens": int(greedy_tokens), "speed": speed,
          "n_threads": int(n_threads or min(4, os.cpu_count() or 1)),
          "exact_cache": bool(exact_cache), "kernels": kernels,
          "sequences": [[[int(t) for t in inputs], [int(t) for t in targets],
                         [float(m) for m in mask]] for inputs, targets, mask in sequences],
          "greedy_prompts": [[int(t) for t in p] for p in greedy_prompts],
          "vocab_limit": None if vocab_limit is None else int(vocab_limit)}
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [_REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  with tempfile.TemporaryDirectory() as tmp:
    spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
    with open(spec_path, "w") as f:
      json.dump(spec, f)
    proc = subprocess.run([sys.executable, "-c", _CHILD, os.path.abspath(__file__), spec_path,
                           out_path], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0 or not os.path.exists(out_path):
      raise RuntimeError(f"llama.cpp measurement of {path} failed (exit {proc.returncode}): "
                         f"{proc.stderr[-2000:]}")
    with open(out_path) as f:
      return json.load(f)
