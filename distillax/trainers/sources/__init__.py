"""Where every model's weights come from: one room (DESIGN.md, "Model sources").

    sources = job_sources(config)          # the student's and the teacher's, made once
    config = resolve_student(config, sources)
    model = sources.student.load(cfg, mesh, rules, seed=seed)

kinds.py: the sources (fresh, preset, Hugging Face directory, earlier run, blocks of another);
select.py: which one a config names; runs.py: an earlier run's student restored alone;
experts.py: the experts a student of teacher blocks keeps (student.from_teacher.experts);
vocabulary.py: the one-tokenizer check; files.py: what a source is on disk; cache_head.py: the
LM head of a hidden-state teacher cache.
"""

from distillax.trainers.sources.files import (hf_tokenizer_file, is_hf_checkpoint,
                                              load_run_config)
from distillax.trainers.sources.kinds import (RUN_FIELDS, BlocksSource, FreshSource, HFSource,
                                              ModelSource, RunSource, place,
                                              resolve_model_config)
from distillax.trainers.sources.runs import as_loaded, checkpoints_of
from distillax.trainers.sources.select import (PRESET_SEED_OFFSET, JobSources,
                                               check_run_shape, job_sources, job_teacher,
                                               resolve_student, student_source,
                                               teacher_model_config, teacher_source)

__all__ = ["BlocksSource", "FreshSource", "HFSource", "JobSources", "ModelSource",
           "PRESET_SEED_OFFSET", "RUN_FIELDS", "RunSource", "as_loaded", "check_run_shape",
           "checkpoints_of", "hf_tokenizer_file", "is_hf_checkpoint", "job_sources",
           "job_teacher", "load_run_config", "place", "resolve_model_config", "resolve_student",
           "student_source", "teacher_model_config", "teacher_source"]
