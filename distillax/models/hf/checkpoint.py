"""Hugging Face safetensors checkpoints in and out (Llama, Gemma, Gemma 2, Qwen 2/3, Mistral,
Qwen3-MoE, Mixtral, gpt-oss, Qwen3.5 and its MoE, Gemma 3/4, SmolLM3, OLMo 3, Phi-3/4,
Qwen3-Next, Llama 4, DeepSeek V3, GLM-4.5; gpt-oss's MXFP4-packed experts are dequantized on
load, Qwen3(.5)-MoE's, Qwen3-Next's, DeepSeek's and GLM's experts are read per expert or fused;
DeepSeek's and GLM's multi-token-prediction layers are skipped with one line).

`load` checks every tensor name and shape against config.json before reading any weights, then
builds each parameter with `jax.make_array_from_callback`: every device's shard is read straight
from the file (only that slice), so a sharded model never exists whole on one host. `save` writes
config.json and model.safetensors (several files plus model.safetensors.index.json past
`max_shard_bytes`) that transformers loads as is; given the tokenizer, also its files, the chat
template and generation_config.json (tokenizer.py), every file with mode 0644.

Which HF tensor each parameter is, and in what layout: names.py.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from distillax import partitioning as pt
from distillax.data.tokenizer import Tokenizer
from distillax.errors import UserError
from distillax import jsonio
from distillax.models import layer_scope
from distillax.models.config import TransformerConfig
from distillax.models.moe import mxfp4
from distillax.models.hf.config import MULTIMODAL, architecture_of, config_from_hf
from distillax.models.hf.config_out import config_to_hf
from distillax.models.hf.names import (Source, fused_experts_stored, join_parts, key_path,
                                       source_of)
from distillax.models.hf.tokenizer import make_readable, write_tokenizer_files
from distillax.models.init import RulesLike, abstract_model, resolve_rules
from distillax.models.transformer import Transformer

INDEX_FILE = "model.safetensors.index.json"
_log = logging.getLogger(__name__)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry
# Multi-token-prediction heads (Qwen3-Next's, Qwen3.5's) that transformers leaves out too.
_IGNORED_PREFIXES = ("mtp.",)



# ---- load -------------------------------------------------------------------------------------

def _read_json(file: Path) -> dict[str, Any]:
  if not file.is_file():
    raise UserError(f"{file} not found; a Hugging Face checkpoint directory needs config.json "
                    f"and *.safetensors files")
  try:
    return json.loads(file.read_text())
  except json.JSONDecodeError as e:
    raise UserError(f"{file} is not valid JSON ({e}); re-export the checkpoint") from None


def _tensor_files(path: Path) -> dict[str, Path]:
  """Tensor name -> file, from the index when there is one, else by listing the files."""
  index_file = path / INDEX_FILE
  if index_file.is_file():
    weight_map = _read_json(index_file).get("weight_map", {})
    for file in sorted(set(weight_map.values())):
      if not (path / file).is_file():
        raise UserError(f"{path / file} (listed in {INDEX_FILE}) not found; the checkpoint is "
                        f"incomplete, copy or download every shard")
    return {name: path / file for name, file in weight_map.items()}
  files = sorted(path.glob("*.safetensors"))
  if not files:
    raise UserError(f"no *.safetensors file in {path}; export the checkpoint with "
                    f"safe_serialization (the default of save_pretrained)")
  names = {}
  for file in files:
    with safe_open(str(file), framework="numpy") as f:
      names.update({name: file for name in f.keys()})
  return names


def check_files(path: str | os.PathLike) -> None:
  """Raises the UserError `load` would for a missing config.json, a missing safetensors file or
  a shard its index lists but the directory lacks, reading no weight: a job checks its sources
  with this before its step compiles."""
  path = Path(path)
  _read_json(path / "config.json")
  _tensor_files(path)


def _text_tower(files: dict[str, Path], hf_config) -> tuple[dict[str, Path], dict[str, str]]:
  """A multimodal wrapper's text decoder tensors under the names of its text-only class
  ('model.language_model.x' as 'model.x', or transformers 4's 'language_model.model.x', as
  Gemma 3 checkpoints are saved; the vision and audio towers and the projector left out), with
  {our name: stored name}; other checkpoints as they are."""
  if (hf_config.get("architectures") or [None])[0] not in MULTIMODAL:
    return files, {}
  prefixes = ("model.language_model.", "language_model.model.")
  stored = {"model." + n[len(p):]: n for n in files for p in prefixes if n.startswith(p)}
  for head in ("lm_head.weight", "language_model.lm_head.weight"):
    if head in files:
      stored["lm_head.weight"] = head
  return {name: files[n] for name, n in stored.items()}, stored


def load(path: str | os.PathLike, *, mesh: Mesh | None = None, rules: RulesLike = None,
         dtype: str | None = None, **config_overrides) -> Transformer:
  """A distillax model from a HF checkpoint directory, placed with the target shardings.

  dtype: param and compute dtype (default float32). config_overrides: other TransformerConfig
  fields, e.g. scan_layers=True, remat='full'. Raises UserError (and returns nothing) when a file
  is missing, the architecture is unsupported or a tensor does not match config.json.
  """
  path = Path(path)
  hf_config = _read_json(path / "config.json")
  config = config_from_hf(hf_config, where=str(path / "config.json"), dtype=dtype,
                          **config_overrides)
  files = _tensor_files(path)
  graphdef, abstract_state = nnx.split(abstract_model(config))
  abstract = nnx.to_pure_dict(abstract_state)
  if mesh is not None:
    shardings = pt.tree_shardings(abstract, pt.logical_tree(abstract_state), mesh,
                                  resolve_rules(rules))
  else:
    shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), abstract)

  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  packed = (hf_config.get("quantization_config") or {}).get("quant_method") == mxfp4.QUANT_METHOD
  with contextlib.ExitStack() as stack:
    files, stored_names = _text_tower(files, hf_config)
    fused = fused_experts_stored(files, config)
    plans = [(source_of(key_path(p), config, fused), x) for p, x in flat]
    reader = _Reader(path, files, stack, packed, config, stored_names)
    _check_tensors(plans, reader, hf_config)  # every name and shape before reading a weight
    arrays = [_make_array(source, x, sharding, reader.tensor)
              for (source, x), sharding in zip(plans, treedef.flatten_up_to(shardings))]
  nnx.replace_by_pure_dict(abstract_state, jax.tree_util.tree_unflatten(treedef, arrays))
  return nnx.merge(graphdef, abstract_state)


class _HostSlice:
  """A safetensors slice handle of framework 'flax' whose blocks come back as numpy arrays
  (bfloat16 ones as ml_dtypes.bfloat16), read on the host's CPU device."""

  def __init__(self, handle):
    self.handle = handle

  def get_shape(self):
    return self.handle.get_shape()

  def __getitem__(self, index):
    with jax.default_device(jax.devices("cpu")[0]):
      return np.asarray(self.handle[index])


class _Reader:
  """Slice handles of a checkpoint's tensors, each file opened once; an MXFP4 checkpoint's
  packed experts (`<name>_blocks` + `<name>_scales`) read as their dequantized tensor."""

  def __init__(self, path: Path, files: dict[str, Path], stack, packed: bool, config,
               stored_names: dict[str, str] | None = None):
    self.path, self.files, self.stack, self.packed, self.config = path, files, stack, packed, config
    self.stored_names = stored_names or {}  # a multimodal wrapper's text tower: its own names
    self.handles: dict[tuple[Path, str], Any] = {}

  def _open(self, file: Path, framework: str):
    if (file, framework) not in self.handles:
      self.handles[file, framework] = self.stack.enter_context(
          safe_open(str(file), framework=framework))
    return self.handles[file, framework]

  def _stored(self, name: str):
    stored = self.stored_names.get(name, name)
    handle = self._open(self.files[name], "numpy").get_slice(stored)
    if handle.get_dtype() != "BF16":
      return handle
    # numpy has no bfloat16: read through JAX (ml_dtypes) on the host instead
    return _HostSlice(self._open(self.files[name], "flax").get_slice(stored))

  def tensor(self, name: str):
    """(slice handle, file, the stored tensors it reads)."""
    pair = mxfp4.packed_names(name)
    if name not in self.files and all(n in self.files for n in pair):
      if not self.packed:
        raise UserError(f"{self.path}: {pair[0]!r} and {pair[1]!r} hold {name!r} MXFP4-packed, "
                        f"but config.json has no quantization_config with quant_method "
                        f"'{mxfp4.QUANT_METHOD}'; restore it from the released config.json")
      return mxfp4.PackedTensor(*map(self._stored, pair)), self.files[pair[0]], pair
    if name not in self.files:
      cfg = self.config
      raise UserError(f"tensor {name!r} not found in the safetensors files of {self.path}; the "
                      f"weights do not match config.json ({cfg.num_layers} layers, "
                      f"tie_word_embeddings={cfg.tie_embeddings})")
    return self._stored(name), self.files[name], (name,)


def _check_tensors(plans, reader: _Reader, hf_config) -> None:
  """Every tensor a parameter needs is there with the shape config.json implies, and nothing
  is left over that the model would drop."""
  used = set()
  for source, x in plans:
    want = source.layout.hf_shape(source.split(x.shape))
    for name in source.names:
      handle, file, names = reader.tensor(name)
      used.update(names)
      got = tuple(handle.get_shape())
      if got != want:
        raise UserError(f"tensor {name!r} in {file.name} has shape {got} but config.json "
                        f"implies {want}; the weights and config.json disagree")
  tied = reader.config.tie_embeddings
  skipped = _prediction_layer_tensors(reader, hf_config)
  unexpected = sorted(n for n in reader.files if n not in used and n not in skipped
                      and not n.endswith(_IGNORED_SUFFIXES)
                      and not n.startswith(_IGNORED_PREFIXES)
                      and not (tied and n == "lm_head.weight"))
  if unexpected:
    raise UserError(f"{reader.path}: tensors {unexpected[:5]} (of {len(unexpected)}) are not "
                    f"part of a {architecture_of(hf_config, str(reader.path))} distillax "
                    f"supports; the checkpoint has features (biases, extra modules) that would "
                    f"be dropped")


def _prediction_layer_tensors(reader: _Reader, hf_config) -> set[str]:
  """The tensors of the multi-token-prediction layers a DeepSeek V3 / GLM-4.5 checkpoint
  carries past its num_hidden_layers (num_nextn_predict_layers): no part of the model, skipped
  with one line."""
  count = int(hf_config.get("num_nextn_predict_layers") or 0)
  first = reader.config.num_layers
  layer_of = lambda name: (int(name.split(".")[2]) if name.startswith("model.layers.")
                           and name.split(".")[2].isdigit() else -1)
  skipped = {n for n in reader.files if count and first <= layer_of(n) < first + count}
  if skipped:
    _log.warning("%s: skipping the %d tensors of %d multi-token-prediction layer(s) (layers %s) "
                 "past num_hidden_layers=%d: distillax reads the main model", reader.path,
                 len(skipped), count, layer_scope.ranges(range(first, first + count)), first)
  return skipped


def _make_array(source: Source, x, sharding, tensor: Callable) -> jax.Array:
  shape, dtype = tuple(x.shape), x.dtype
  memo: dict[tuple, np.ndarray] = {}  # replicated shards read once

  def callback(index):
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    key = tuple(s.indices(n) for s, n in zip(index, shape))
    if key not in memo:
      n = len(source.lead)
      picks = [range(*s.indices(d)) for s, d in zip(index[:n], shape[:n])]
      inner = source.split(shape)
      blocks = [source.layout.read(tensor(source.names[int(np.ravel_multi_index(i, source.lead))
                                                       if n else 0])[0], index[n:], inner)
                for i in itertools.product(*picks)]
      block = np.stack(blocks).reshape(tuple(map(len, picks)) + blocks[0].shape)
      memo[key] = np.ascontiguousarray(block.astype(dtype))
    return memo[key]

  return jax.make_array_from_callback(shape, sharding, callback)


# ---- save -------------------------------------------------------------------------------------

def _host_array(x: jax.Array) -> np.ndarray:
  if not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(x)


def _tensor_names_and_bytes(model: Transformer) -> list[tuple[str, int]]:
  """(HF name, bytes) of every tensor `hf_tensors` yields, in the same order, from shapes only."""
  config = model.config
  values = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  out, partial = [], {}  # a shared tensor: (bytes, share) of the parts seen so far
  for path, x in jax.tree_util.tree_flatten_with_path(values)[0]:
    source = source_of(key_path(path), config)
    nbytes = int(np.prod(source.split(x.shape))) * x.dtype.itemsize
    for name in source.names:
      if not source.layout.shared:
        out.append((name, nbytes))
        continue
      _, share, whole = source.layout.parts()
      seen_bytes, seen_share = partial.pop(name, (0, 0))
      if seen_share + share == whole:  # the last part completes it, as in hf_tensors
        out.append((name, seen_bytes + nbytes))
      else:
        partial[name] = (seen_bytes + nbytes, seen_share + share)
  return out


def hf_tensors(model: Transformer):
  """Yields (HF name, numpy array) for every parameter, one tensor at a time (a tensor two
  parameters share, gpt-oss's gate_up_proj, when its second half arrives)."""
  config = model.config
  values = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  partial: dict[str, tuple] = {}  # a shared tensor: (its parts so far by key, their share)
  for path, x in jax.tree_util.tree_flatten_with_path(values)[0]:
    source = source_of(key_path(path), config)
    host = _host_array(x)
    parts = host.reshape((-1,) + source.split(host.shape))
    for name, part in zip(source.names, parts):
      part = source.layout.to_hf(part)
      if source.layout.shared:
        key, share, whole = source.layout.parts()
        got, seen_share = partial.pop(name, ({}, 0))
        got[key] = part
        if seen_share + share < whole:
          partial[name] = (got, seen_share + share)
          continue
        part = join_parts(source.layout, got)
      yield name, np.ascontiguousarray(part)


def save(model: Transformer, path: str | os.PathLike, *, tokenizer: Tokenizer | None = None,
         chat_template: str | None = None, max_shard_bytes: int = 4 * 1024**3) -> None:
  """Writes config.json + model.safetensors (or shards + index) that transformers can load,
  and with `tokenizer` (the one the model was trained with) the files AutoTokenizer and
  generate read; `chat_template` replaces the tokenizer's own template (tokenizer.py).

  Shards are planned from shapes and written one at a time, so the host holds at most one
  shard of gathered weights.
  """
  path = Path(path)
  hf_config = config_to_hf(model.config)  # fails early for configs HF cannot express
  plan = _tensor_names_and_bytes(model)
  shard_of, sizes = {}, [0]
  for name, nbytes in plan:
    if sizes[-1] and sizes[-1] + nbytes > max_shard_bytes:
      sizes.append(0)
    shard_of[name] = len(sizes) - 1
    sizes[-1] += nbytes
  n = len(sizes)
  file_name = lambda i: ("model.safetensors" if n == 1
                         else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
  writer = jax.process_index() == 0
  if writer:
    path.mkdir(parents=True, exist_ok=True)
  current, current_index = {}, 0
  for name, array in hf_tensors(model):  # every process joins the gathers
    if shard_of[name] != current_index:
      if writer:
        save_file(current, str(path / file_name(current_index)), metadata={"format": "pt"})
      current, current_index = {}, shard_of[name]
    current[name] = array
  if not writer:
    return
  save_file(current, str(path / file_name(current_index)), metadata={"format": "pt"})
  if n > 1:
    index = {"metadata": {"total_size": sum(sizes)},
             "weight_map": {name: file_name(i) for name, i in shard_of.items()}}
    (path / INDEX_FILE).write_text(jsonio.dumps(index, indent=2))
  (path / "config.json").write_text(jsonio.dumps(hf_config, indent=2))
  if tokenizer is not None:
    write_tokenizer_files(tokenizer, path, max_len=model.config.max_seq_len,
                          chat_template=chat_template)
  make_readable(path)
