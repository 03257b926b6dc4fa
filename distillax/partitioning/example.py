"""A model-shaped abstract tree: the parameters of a small decoder, as shapes only.

It lets the partitioning core be shown (`make demo` before the real job existed) and pinned by
golden snapshots without depending on the model code.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P


def model_shaped_tree(vocab: int = 512, embed: int = 128, layers: int = 2, heads: int = 16,
                      kv_heads: int = 8, head_dim: int = 8, mlp: int = 256,
                      dtype=np.float32):
  """(abstract params, logical specs) shaped like a Llama-style decoder."""
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
  params, logical = {"embedder": {"embedding": sds(vocab, embed)}}, {
      "embedder": {"embedding": P("vocab", "embed")}}
  for i in range(layers):
    params[f"layer_{i}"] = {
        "attn": {"q": sds(embed, heads, head_dim), "k": sds(embed, kv_heads, head_dim),
                 "v": sds(embed, kv_heads, head_dim), "o": sds(heads, head_dim, embed)},
        "mlp": {"gate": sds(embed, mlp), "up": sds(embed, mlp), "down": sds(mlp, embed)},
        "attn_norm": {"scale": sds(embed)}, "mlp_norm": {"scale": sds(embed)},
    }
    logical[f"layer_{i}"] = {
        "attn": {"q": P("embed", "heads", "head_dim"), "k": P("embed", "kv_heads", "head_dim"),
                 "v": P("embed", "kv_heads", "head_dim"), "o": P("heads", "head_dim", "embed")},
        "mlp": {"gate": P("embed", "mlp"), "up": P("embed", "mlp"), "down": P("mlp", "embed")},
        "attn_norm": {"scale": P("embed")}, "mlp_norm": {"scale": P("embed")},
    }
  params["final_norm"] = {"scale": sds(embed)}
  logical["final_norm"] = {"scale": P("embed")}
  params["lm_head"] = {"kernel": sds(embed, vocab)}
  logical["lm_head"] = {"kernel": P("embed", "vocab")}
  return params, logical
