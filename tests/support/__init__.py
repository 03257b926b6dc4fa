"""What many test rooms share, written once: tiny model presets, random models made with numpy,
jitted forwards (models.py); tiny engines, batches and training loops (engines.py); the
benchmarks' hand-written parameter counts (bench.py). Domain references (numpy losses, fake
quantizers, Markov tables, chat fixtures) stay next to the tests that own them."""
