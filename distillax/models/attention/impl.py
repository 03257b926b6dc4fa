"""Which attention implementation one call runs: `model.attention_impl` and what the call needs,
decided in one pure function, so models never look at the platform themselves.

- `reference` (layer.py): the whole fp32 (B, K, G, L, S) logits and probabilities; the only
  path that can hand the probabilities out (attention transfer).
- `blockwise` (blockwise.py): pure JAX online softmax over key blocks with a backward
  pass that recomputes, so nothing L x S is ever held; every backend, every platform.
- `cudnn` / `splash` (fused.py): the NVIDIA cuDNN flash kernel and the Pallas TPU splash
  kernel. Not yet run on a real device: splash is checked against the reference in Pallas
  interpret mode on CPU and lowered by the TPU compiler (`plan --target`); cuDNN is lowered by
  the CUDA plugin's compiler given the cuDNN wheel.
- `tokamax` (tokamax.py): tokamax's Mosaic GPU flash attention on a GPU, its XLA path
  on CPU (the tests' check); refused on a TPU (splash is the TPU's).
- `auto`: a fused kernel where the platform has one that supports what the call needs, blockwise
  otherwise; the reference when probabilities are asked for. Decode steps against a KV cache
  (one query per row) run decode.py's Pallas kernel on a TPU when the cache is a scanned
  stack (it reads the stack in place), the reference elsewhere: their scores are (B, H, 1, S),
  small; a prefill into an empty cache (KVCache.empty) attends only its own tokens, by what a
  training forward of them runs (layer.Attention._attend_own), and a later multi-token call
  into a cache runs blockwise (the fused kernels here assume queries and keys start at the
  same index).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging

import jax

from distillax.errors import ConfigError
from distillax.models import layer_scope
from distillax.models.config import ATTENTION_IMPLS as IMPLEMENTATIONS
from distillax.partitioning import active_rules

_FUSED_PLATFORM = {"cudnn": "gpu", "splash": "tpu"}
# Device platforms as JAX names them, by the platform names `choose` takes.
_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
_log = logging.getLogger(__name__)
_logged: set[tuple[str, str, str]] = set()
_RECORD: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "distillax_attention_choices", default=None)


@dataclasses.dataclass(frozen=True)
class AttentionNeeds:
  """What one attention call asks of an implementation (all known at trace time)."""

  probs: bool = False  # the caller reads the probabilities (attention-transfer distillation)
  cached: bool = False  # the queries attend a KV cache (generation)
  query_len: int = 1  # L
  key_len: int = 1  # S
  segments: bool = False  # segment ids are given (packed documents, padding)
  window: bool = False  # a sliding window applies to some layer
  softcap: bool = False  # the attention logits are soft-capped (Gemma 2)
  dtype: str = "float32"  # compute dtype of queries, keys and values
  head_dim: int = 64
  sinks: bool = False  # a learned per-head logit joins the softmax denominator (gpt-oss)
  stacked_cache: bool = False  # the KV cache is the layers' stack, readable in place (decode.py)


def cudnn_unsupported(needs: AttentionNeeds) -> str | None:
  """Why cuDNN flash attention (through jax.nn.dot_product_attention) cannot serve `needs`."""
  if needs.softcap:
    return "cuDNN flash attention has no logit soft-cap"
  if needs.sinks:
    return "cuDNN flash attention has no attention sinks"
  if needs.dtype not in ("bfloat16", "float16"):
    return f"cuDNN flash attention runs in bfloat16/float16, not {needs.dtype}"
  if needs.head_dim > 128 or needs.head_dim % 8:
    return f"head_dim={needs.head_dim}: cuDNN's backward wants a multiple of 8 up to 128"
  return None


def splash_unsupported(needs: AttentionNeeds) -> str | None:
  """Why Pallas splash attention cannot serve `needs`."""
  if needs.sinks:
    return "splash attention has no attention sinks"
  if needs.query_len % 128 or needs.key_len % 128:
    return f"sequence length {needs.query_len} is not a multiple of splash's 128-token blocks"
  return None


def tokamax_unsupported(needs: AttentionNeeds) -> str | None:
  """Why tokamax's flash attention (Mosaic GPU) cannot serve `needs`."""
  if needs.sinks:
    return "tokamax's flash attention has no attention sinks"
  if needs.dtype not in ("bfloat16", "float16"):
    return f"tokamax's Mosaic GPU attention runs in bfloat16/float16, not {needs.dtype}"
  return None


def _tokamax(platform: str, needs: AttentionNeeds) -> tuple[str, str]:
  """'tokamax' asked for: its Mosaic GPU kernel on a GPU; its XLA path on CPU (tests); none on
  a TPU, which has splash."""
  if platform == "tpu":
    raise ConfigError("model.attention_impl='tokamax' runs tokamax's GPU kernel; on a TPU use "
                      "'splash' or 'auto'")
  if platform != "gpu":
    if needs.sinks:
      raise ConfigError(f"model.attention_impl='tokamax' cannot run this model: "
                        f"{tokamax_unsupported(needs)}; use 'auto' or 'blockwise'")
    return "tokamax", f"tokamax's XLA path: platform {platform!r} has no tokamax kernel"
  why = tokamax_unsupported(needs)
  if why:
    raise ConfigError(f"model.attention_impl='tokamax' cannot run this model: {why}; use "
                      f"'auto' or 'blockwise'")
  return "tokamax", "as configured: Mosaic GPU flash attention"


_UNSUPPORTED = {"cudnn": cudnn_unsupported, "splash": splash_unsupported}


def decode_unsupported(requested: str, platform: str, needs: AttentionNeeds) -> str | None:
  """Why the TPU decode kernel (decode.py) cannot serve a one-query call against a cache."""
  if platform != "tpu" or requested not in ("auto", "splash"):
    return "the decode kernel runs on a TPU under attention_impl 'auto' or 'splash'"
  if not needs.stacked_cache:
    return "the cache is not a scanned stack"
  if needs.sinks:
    return "the decode kernel has no attention sinks"
  return None


def _explicit_fused(requested: str, platform: str, needs: AttentionNeeds) -> tuple[str, str]:
  want = _FUSED_PLATFORM[requested]
  if platform != want:
    raise ConfigError(f"model.attention_impl={requested!r} needs JAX platform {want!r}, but this "
                      f"run's is {platform!r}; use 'auto' (it picks what the platform has) or "
                      f"'blockwise'")
  why = _UNSUPPORTED[requested](needs)
  if why:
    raise ConfigError(f"model.attention_impl={requested!r} cannot run this model: {why}; use "
                      f"'auto' or 'blockwise'")
  return requested, "as configured"


def choose(requested: str, platform: str, needs: AttentionNeeds) -> tuple[str, str]:
  """(implementation, why) for one call. platform: 'cpu', 'gpu' or 'tpu' (compile_platform()).

  Raises ConfigError for an explicit fused kernel the platform or the model cannot run."""
  if requested not in IMPLEMENTATIONS:
    raise ConfigError(f"model.attention_impl={requested!r}; choose one of "
                      f"{', '.join(IMPLEMENTATIONS)}")
  if needs.probs:
    return "reference", "attention probabilities requested: only the reference path forms them"
  if needs.cached:
    if needs.query_len == 1:
      why = decode_unsupported(requested, platform, needs)
      if why is None:
        return "decode", "one query per row: the Pallas kernel reads the stacked cache in place"
      return "reference", f"one query per row against the KV cache ({why})"
    if requested == "reference":
      return "reference", "as configured"
    return "blockwise", "KV-cache prefill: the fused kernels assume queries and keys start together"
  if requested in ("reference", "blockwise"):
    return requested, "as configured"
  if requested == "tokamax":
    return _tokamax(platform, needs)
  if requested in _FUSED_PLATFORM:
    return _explicit_fused(requested, platform, needs)
  for kernel, kernel_platform in _FUSED_PLATFORM.items():
    if platform == kernel_platform:
      why = _UNSUPPORTED[kernel](needs)
      if why is None:
        return kernel, f"fused kernel of platform {platform!r}"
      return "blockwise", why
  return "blockwise", f"platform {platform!r} has no fused attention kernel here"


def _mesh_platform(mesh) -> str | None:
  """The platform of a concrete mesh's devices, or of an abstract mesh's abstract device."""
  if isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size:
    return mesh.devices.flat[0].platform
  if isinstance(mesh, jax.sharding.AbstractMesh) and mesh.abstract_device is not None:
    return mesh.abstract_device.platform
  return None


def compile_platform() -> str:
  """The platform the step being traced is compiled for: that of the devices of the mesh in
  force (the step's sharding rules, or jax's own mesh context inside shard_map / set_mesh),
  else jax.default_backend(). Why not the default backend alone: `plan --target` compiles for a
  TPU or GPU topology from a CPU host, where jax.default_backend() is 'cpu' but the program runs
  on the target's chips, and must get the target's kernels."""
  active = active_rules()
  platform = _mesh_platform(active.mesh if active is not None else None)
  if platform is None:
    platform = _mesh_platform(jax.sharding.get_abstract_mesh())
  platform = platform or jax.default_backend()
  return _PLATFORM_ALIASES.get(platform, platform)


@contextlib.contextmanager
def recorded_choices():
  """Collects every (requested, implementation, why) `resolve` decides inside, one entry per
  traced call (a scanned layer stack is traced once): what `plan` reports per compiled step."""
  found: list[tuple[str, str, str]] = []
  token = _RECORD.set(found)
  try:
    yield found
  finally:
    _RECORD.reset(token)


def resolve(requested: str, needs: AttentionNeeds) -> str:
  """`choose` on the platform the step compiles for, logging each distinct choice once."""
  impl, why = choose(requested, compile_platform(), needs)
  key = (requested, impl, why)
  record = _RECORD.get()
  if record is not None and layer_scope.recording():
    record.append(key)
  layer_scope.record("attention", impl)
  if key not in _logged:
    _logged.add(key)
    _log.info("attention: model.attention_impl=%r runs %s (%s)", requested, impl, why)
  return impl
