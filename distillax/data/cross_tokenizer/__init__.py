"""Data for two tokenizers at once: each token's bytes, the alignment of two tokenizations of one
text, and the paired rows and samples a cross-tokenizer job trains on."""
