"""Hugging Face safetensors checkpoints in and out (Llama, Gemma, Gemma 2, Qwen 2/3, Mistral,
Qwen3-MoE, Mixtral).

`load` checks every tensor name and shape against config.json before reading any weights, then
builds each parameter with `jax.make_array_from_callback`: every device's shard is read straight
from the file (only that slice), so a sharded model never exists whole on one host. `save` writes
config.json and model.safetensors (several files plus model.safetensors.index.json past
`max_shard_bytes`) that transformers loads as is; given the tokenizer, also its files, the chat
template and generation_config.json (hf_tokenizer.py), every file with mode 0644.

A stacked parameter has leading dims HF stores as separate tensors: the layers under
`scan_layers`, the experts of a mixture (HF checkpoints keep one tensor per expert,
`mlp.experts.{e}.gate_proj.weight`), or both; its `_Source` lists their names in row-major order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
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
from distillax.framework import jsonio
from distillax.models.config import TransformerConfig
from distillax.models.hf_config import (architecture_of, config_from_hf, config_to_hf,
                                        hf_architecture)
from distillax.models.hf_tokenizer import make_readable, write_tokenizer_files
from distillax.models.init import RulesLike, abstract_model, resolve_rules
from distillax.models.transformer import Transformer

INDEX_FILE = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


# ---- how one parameter maps to one HF tensor ------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Layout:
  """Ours <-> HF for one tensor kind. HF linear weights are (out, in); ours are (in, ...out)."""

  # 'copy' | 'T' | 'out_heads' (D,H,K)<-(H*K,D) | 'in_heads' (H,K,D)<-(D,H*K)
  # | 'flat_heads' (H,K)<-(H*K,) (q/k/v biases)
  kind: str

  def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
    if self.kind == "copy":
      return ours
    if self.kind == "T":
      return ours[::-1]
    if self.kind == "out_heads":
      return (ours[1] * ours[2], ours[0])
    if self.kind == "flat_heads":
      return (ours[0] * ours[1],)
    return (ours[2], ours[0] * ours[1])

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    if self.kind == "copy":
      return x
    if self.kind == "T":
      return x.T
    if self.kind == "out_heads":
      return x.reshape(x.shape[0], -1).T
    if self.kind == "flat_heads":
      return x.reshape(-1)
    return x.reshape(-1, x.shape[2]).T

  def read(self, tensor, index: tuple[slice, ...], ours: tuple[int, ...]) -> np.ndarray:
    """The block `ours[index]` read from the HF tensor slice handle (only what it needs)."""
    r = [range(*s.indices(n)) for s, n in zip(index, ours)]
    sl = lambda rg: slice(rg.start, rg.stop)
    if self.kind == "copy":
      return tensor[tuple(sl(x) for x in r)]
    if self.kind == "T":
      return tensor[sl(r[1]), sl(r[0])].T
    if self.kind == "out_heads":  # ours (D, H, K) from hf (H*K, D)
      D, H, K = ours
      rows = tensor[r[1].start * K:r[1].stop * K, sl(r[0])]
      return rows.reshape(len(r[1]), K, len(r[0]))[:, sl(r[2]), :].transpose(2, 0, 1)
    if self.kind == "flat_heads":  # ours (H, K) from hf (H*K,)
      H, K = ours
      return tensor[r[0].start * K:r[0].stop * K].reshape(len(r[0]), K)[:, sl(r[1])]
    H, K, D = ours  # 'in_heads': ours (H, K, D) from hf (D, H*K)
    cols = tensor[sl(r[2]), r[0].start * K:r[0].stop * K]
    return cols.reshape(len(r[2]), len(r[0]), K)[:, :, sl(r[1])].transpose(1, 2, 0)


# Expert weights: ours (expert, in, out) stacked from one HF (out, in) tensor per expert "{e}".
_EXPERT_NAMES = {  # architecture -> (module, router, gate, up, down)
    "MixtralForCausalLM": ("block_sparse_moe", "gate", "w1", "w3", "w2"),
    "Qwen3MoeForCausalLM": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
}


def _expert_sources(config: TransformerConfig) -> dict[tuple[str, ...], tuple[str, _Layout]]:
  module, router, gate, up, down = _EXPERT_NAMES[hf_architecture(config)]
  return {
      ("mlp", "router"): (f"{module}.{router}.weight", _Layout("T")),
      ("mlp", "gate"): (f"{module}.experts.{{e}}.{gate}.weight", _Layout("T")),
      ("mlp", "up"): (f"{module}.experts.{{e}}.{up}.weight", _Layout("T")),
      ("mlp", "down"): (f"{module}.experts.{{e}}.{down}.weight", _Layout("T")),
  }


def _layer_sources(config: TransformerConfig) -> dict[tuple[str, ...], tuple[str, _Layout]]:
  """Block sub-path -> (HF name suffix under model.layers.{i}., layout); a suffix with "{e}"
  names one tensor per expert."""
  mlp_norm = "pre_feedforward_layernorm" if config.use_post_norms else "post_attention_layernorm"
  sources = {
      ("attn_norm", "scale"): ("input_layernorm.weight", _Layout("copy")),
      ("attn", "q"): ("self_attn.q_proj.weight", _Layout("out_heads")),
      ("attn", "k"): ("self_attn.k_proj.weight", _Layout("out_heads")),
      ("attn", "v"): ("self_attn.v_proj.weight", _Layout("out_heads")),
      ("attn", "o"): ("self_attn.o_proj.weight", _Layout("in_heads")),
      ("mlp_norm", "scale"): (f"{mlp_norm}.weight", _Layout("copy")),
      ("mlp", "gate"): ("mlp.gate_proj.weight", _Layout("T")),
      ("mlp", "up"): ("mlp.up_proj.weight", _Layout("T")),
      ("mlp", "down"): ("mlp.down_proj.weight", _Layout("T")),
  }
  if config.num_experts:
    for key in ("gate", "up", "down"):
      del sources[("mlp", key)]
    sources.update(_expert_sources(config))
  if config.use_post_norms:
    sources[("post_attn_norm", "scale")] = ("post_attention_layernorm.weight", _Layout("copy"))
    sources[("post_mlp_norm", "scale")] = ("post_feedforward_layernorm.weight", _Layout("copy"))
  if config.qkv_bias:
    for proj in "qkv":
      sources[("attn", f"{proj}_bias")] = (f"self_attn.{proj}_proj.bias", _Layout("flat_heads"))
  if config.qk_norm:
    sources[("attn", "q_norm", "scale")] = ("self_attn.q_norm.weight", _Layout("copy"))
    sources[("attn", "k_norm", "scale")] = ("self_attn.k_norm.weight", _Layout("copy"))
  return sources


_TOP_SOURCES = {
    ("embedder", "embedding"): ("model.embed_tokens.weight", _Layout("copy")),
    ("final_norm", "scale"): ("model.norm.weight", _Layout("copy")),
    ("lm_head",): ("lm_head.weight", _Layout("T")),
}


@dataclasses.dataclass(frozen=True)
class _Source:
  """Where one of our parameters comes from: HF tensor names, one per index of the leading
  stacked dims `lead` (layers under scan, experts, both: row-major; () = one tensor)."""

  names: tuple[str, ...]
  layout: _Layout
  lead: tuple[int, ...] = ()

  def split(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one HF tensor's block in ours: `shape` without the stacked dims."""
    return tuple(shape[len(self.lead):])


def _source_of(path: tuple, config: TransformerConfig) -> _Source:
  keys = tuple(str(k) for k in path)
  if keys[0] != "layers":
    name, layout = _TOP_SOURCES[keys]
    return _Source((name,), layout)
  sources = _layer_sources(config)
  suffix, layout = sources[keys[1:] if config.scan_layers else keys[2:]]
  layers = range(config.num_layers) if config.scan_layers else [keys[1]]
  experts = range(config.num_experts) if "{e}" in suffix else [0]
  lead = (((config.num_layers,) if config.scan_layers else ())
          + ((config.num_experts,) if "{e}" in suffix else ()))
  names = tuple(f"model.layers.{i}.{suffix.format(e=e)}" for i in layers for e in experts)
  return _Source(names, layout, lead)


def _key_path(path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)


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
  plans = [(_source_of(_key_path(p), config), x) for p, x in flat]
  used = set()
  with contextlib.ExitStack() as stack:
    handles: dict[Path, Any] = {}

    def tensor(name: str):
      if name not in files:
        raise UserError(f"tensor {name!r} not found in the safetensors files of {path}; the "
                        f"weights do not match config.json ({config.num_layers} layers, "
                        f"tie_word_embeddings={config.tie_embeddings})")
      file = files[name]
      if file not in handles:
        handles[file] = stack.enter_context(safe_open(str(file), framework="numpy"))
      return handles[file].get_slice(name), file

    # Validate every name and shape before reading a single weight.
    for source, x in plans:
      want = source.layout.hf_shape(source.split(x.shape))
      for name in source.names:
        used.add(name)
        handle, file = tensor(name)
        got = tuple(handle.get_shape())
        if got != want:
          raise UserError(f"tensor {name!r} in {file.name} has shape {got} but config.json "
                          f"implies {want}; the weights and config.json disagree")
    unexpected = sorted(n for n in files if n not in used and not n.endswith(_IGNORED_SUFFIXES)
                        and not (config.tie_embeddings and n == "lm_head.weight"))
    if unexpected:
      raise UserError(f"{path}: tensors {unexpected[:5]} (of {len(unexpected)}) are not part of "
                      f"a {architecture_of(hf_config, str(path))} distillax supports; the "
                      f"checkpoint has features (biases, extra modules) that would be dropped")

    arrays = [_make_array(source, x, sharding, tensor)
              for (source, x), sharding in zip(plans, treedef.flatten_up_to(shardings))]
  nnx.replace_by_pure_dict(abstract_state, jax.tree_util.tree_unflatten(treedef, arrays))
  return nnx.merge(graphdef, abstract_state)


def _make_array(source: _Source, x, sharding, tensor: Callable) -> jax.Array:
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
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(values)[0]:
    source = _source_of(_key_path(path), config)
    nbytes = int(np.prod(source.split(x.shape))) * x.dtype.itemsize
    out += [(name, nbytes) for name in source.names]
  return out


def hf_tensors(model: Transformer):
  """Yields (HF name, numpy array) for every parameter, one tensor at a time."""
  config = model.config
  values = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for path, x in jax.tree_util.tree_flatten_with_path(values)[0]:
    source = _source_of(_key_path(path), config)
    host = _host_array(x)
    parts = host.reshape((-1,) + source.split(host.shape))
    for name, part in zip(source.names, parts):
      yield name, np.ascontiguousarray(source.layout.to_hf(part))


def save(model: Transformer, path: str | os.PathLike, *, tokenizer: Tokenizer | None = None,
         chat_template: str | None = None, max_shard_bytes: int = 4 * 1024**3) -> None:
  """Writes config.json + model.safetensors (or shards + index) that transformers can load,
  and with `tokenizer` (the one the model was trained with) the files AutoTokenizer and
  generate read; `chat_template` replaces the tokenizer's own template (hf_tokenizer.py).

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
