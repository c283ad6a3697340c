"""What the release's model card says about the data of a run trained on ``train.data``."""

from olmoflow.pipeline.stages.release import _raw_summary


def test_eval_sets_read_only_by_decontamination_are_not_counted_as_sources():
    lineage = {
        "raw_files": [{"path": p} for p in ("a.jsonl", "b.warc", "arc.jsonl", "gsm8k.jsonl")],
        "steps": [
            {"stage": "ingest", "inputs": [{"path": "a.jsonl", "made_by": None},
                                           {"path": "b.warc", "made_by": None}]},
            {"stage": "decontaminate", "inputs": [{"path": "arc.jsonl", "made_by": None},
                                                  {"path": "gsm8k.jsonl", "made_by": None},
                                                  {"path": "docs", "made_by": "documents"}]},
        ],
    }
    assert _raw_summary(lineage) == ("2 raw source file(s), 2 evaluation file(s) read for "
                                     "decontamination")
    lineage["steps"] = lineage["steps"][:1]
    lineage["raw_files"] = lineage["raw_files"][:2]
    assert _raw_summary(lineage) == "2 raw source file(s)"
