"""Attention: the layer (GQA, masks, KV cache) and its implementations behind one
`model.attention_impl` switch (reference, blockwise, splash/cuDNN, tokamax)."""
