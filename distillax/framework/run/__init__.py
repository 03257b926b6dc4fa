"""The run's services around the engine: checkpoints, metric writers and metrics, logs, progress,
preemption, profiling and the multi-process runtime."""
