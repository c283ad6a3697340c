"""The data engine: a Dolma-style pipeline over a data run directory (:mod:`.runner`), its steps
as records (:mod:`.step`, :mod:`.steps`) and its report (:mod:`.report`)."""

from olmoflow.data.engine.runner import (
    DATA_MARKER,
    STEP_DIRS,
    STEP_NAMES,
    STEPS,
    DataConfig,
    Engine,
    QualityConfig,
    SourceConfig,
    Step,
    StepOutcome,
    TokenizeStepConfig,
    error_count,
    error_examples,
    expand_paths,
    legacy_output_problem,
    load_data_config,
    relative_shards,
    step_stats,
    summary_line,
    validate,
)

__all__ = ["DATA_MARKER", "STEPS", "STEP_DIRS", "STEP_NAMES", "DataConfig", "Engine",
           "QualityConfig", "SourceConfig", "Step", "StepOutcome", "TokenizeStepConfig",
           "error_count", "error_examples", "expand_paths", "legacy_output_problem",
           "load_data_config", "relative_shards", "step_stats", "summary_line", "validate"]
