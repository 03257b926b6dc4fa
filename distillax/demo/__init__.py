"""The main job (`distillax demo`, `make demo`): teacher -> scratch student -> distilled -> QAT
q4_0 -> GGUF in llama.cpp -> report."""

from distillax.demo.pipeline import DemoPipeline, run_demo
from distillax.demo.stages import stage_config

__all__ = ["DemoPipeline", "run_demo", "stage_config"]
