"""The main job (`make demo`): teacher -> scratch student -> distilled -> QAT int4 -> report."""

from distillax.demo.pipeline import DemoPipeline, stage_config
