"""The table of stages, in flow order: one entry per stage, defined in its family's module."""

from __future__ import annotations

from olmoflow.pipeline.stage import StageTable, register_flow_table
from olmoflow.pipeline.stages.data import CLEAN, COLLECT, TOKENIZE
from olmoflow.pipeline.stages.eval import EVALUATE
from olmoflow.pipeline.stages.infer import GENERATE
from olmoflow.pipeline.stages.posttrain import POSTTRAIN
from olmoflow.pipeline.stages.release import RELEASE
from olmoflow.pipeline.stages.tokenizer import TRAIN_TOKENIZER
from olmoflow.pipeline.stages.train import PRETRAIN

STAGES = register_flow_table(StageTable([COLLECT, CLEAN, TRAIN_TOKENIZER, TOKENIZE, PRETRAIN,
                                         *POSTTRAIN, EVALUATE, GENERATE, RELEASE]))
