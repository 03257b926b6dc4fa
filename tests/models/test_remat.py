"""The attention-saving remat policies (models/remat.py) over splash: the same values and
gradients as `full`, with the kernel's forward not run again in the backward pass. The blockwise
path's (a whole decoder) is in test_transformer.py's remat test."""

import jax
import jax.numpy as jnp
import numpy as np

from distillax.models import remat
from distillax.models.attention.fused import splash_attention
from tests.support import chip

SAVING = ("save_attention", "save_attention_qkv", "save_attention_up", "save_attention_mlp")


def _splash_block(w, x_BxLxD):
  """A block's attention half as the model runs it: projections, names, splash (interpret mode
  on CPU, the Mosaic kernel on a TPU), the output projection."""
  q = jnp.einsum("BLD,DKGH->BLKGH", x_BxLxD, w["q"])
  k = jnp.einsum("BLD,DKH->BLKH", x_BxLxD, w["k"])
  v = jnp.einsum("BLD,DKH->BLKH", x_BxLxD, w["v"])
  q, k, v = remat.name_qkv(q, k, v)
  out = splash_attention(q, k, v, scale=q.shape[-1] ** -0.5, interpret=chip.interpret(),
                         blocks=(128, 128, 128))
  return jnp.einsum("BLKGH,KGHD->BLD", out, w["o"])


def _weights(D, K, G, H):
  keys = jax.random.split(jax.random.key(0), 5)
  w = {"q": jax.random.normal(keys[0], (D, K, G, H)) * D ** -0.5,
       "k": jax.random.normal(keys[1], (D, K, H)) * D ** -0.5,
       "v": jax.random.normal(keys[2], (D, K, H)) * D ** -0.5,
       "o": jax.random.normal(keys[3], (K, G, H, D)) * (K * G * H) ** -0.5}
  return w, keys[4]


def _loss_fn(policy):
  block = jax.checkpoint(_splash_block, policy=remat.POLICIES[policy])
  # Squared: the loss needs the forward's output, so the forward runs in the forward pass.
  return lambda w, x: jnp.sum(block(w, x) ** 2)


def _splash_forwards(compiled_hlo: str) -> int:
  return compiled_hlo.count('custom_call_target="tpu_custom_call"')


def test_saving_policies_keep_splash_output_and_do_not_run_its_forward_again():
  B, L, K, G, H, D = 2, 256, 2, 2, 128, 64
  w, key = _weights(D, K, G, H)
  x = jax.random.normal(key, (B, L, D))
  results = {}
  for policy in ("full", *SAVING):
    fn = jax.jit(jax.value_and_grad(_loss_fn(policy), argnums=(0, 1)))
    compiled = fn.lower(w, x).compile()
    cost = compiled.cost_analysis()
    results[policy] = (fn(w, x), (cost[0] if isinstance(cost, list) else cost)["flops"],
                       compiled.as_text())
  (loss0, grads0), flops0, hlo0 = results["full"]
  for policy in SAVING:
    (loss, grads), flops, hlo = results[policy]
    chip.assert_close(np.asarray(loss), np.asarray(loss0), atol=0, rtol=1e-6)
    jax.tree.map(lambda a, b: chip.assert_close(np.asarray(a), np.asarray(b), atol=1e-6,
                                                rtol=1e-5, err_msg=policy), grads, grads0)
    if chip.on_tpu():  # the kernels are custom calls the cost analysis does not see
      # full: forward, forward again, fused backward; saving: forward, backward.
      assert (_splash_forwards(hlo0), _splash_forwards(hlo)) == (3, 2), policy
    else:  # interpret mode: the kernel's work is ordinary HLO, counted
      assert flops < flops0, policy
