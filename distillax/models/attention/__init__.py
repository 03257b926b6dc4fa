"""Attention: the layer (GQA, masks, KV cache), DeepSeek's multi-head latent attention, and the
implementations behind one `model.attention_impl` switch (reference, blockwise, splash/cuDNN,
tokamax)."""
