"""Stage records and the table of stages: the flow's table is consistent with the run config, and
a mistake in a table is caught where the table is made."""

from __future__ import annotations

import dataclasses

import pytest

from olmoflow.config import all_keys
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import RunConfig
from olmoflow.pipeline.stage import Stage, StageTable
from olmoflow.pipeline.stages import STAGES
from olmoflow.run_dir import RunDir


def _noop(cfg, progress):
    raise AssertionError("not run in these tests")


def _resolves(cfg: RunConfig, dotted: str) -> bool:
    node = cfg
    for part in dotted.split("."):
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True


def test_every_key_a_stage_names_is_a_config_key():
    """A renamed config key left behind in a record would silently drop out of a fingerprint (or
    make every run resume from nowhere): each section, bookkeeping key and resume key resolves."""
    cfg = RunConfig()
    keys = set(all_keys(RunConfig))
    for stage in STAGES:
        for sec in stage.sections:
            assert _resolves(cfg, sec), (stage.name, sec)
        for key in stage.ignore:  # inside one of the stage's sections, or it ignores nothing
            assert _resolves(cfg, key), (stage.name, key)
            assert any(key == s or key.startswith(s + ".") for s in stage.sections), key
        if stage.trains is not None:
            assert stage.trains.resume_key in keys, stage.name


def test_the_flow_table_is_in_run_order_and_each_stage_has_a_directory(tmp_path):
    names = STAGES.names
    assert names[0] == "collect" and names[-1] == "release"
    for stage in STAGES:
        for up in stage.upstream:
            assert names.index(up) < names.index(stage.name)
        assert RunDir(tmp_path).stage(stage.name).parent == tmp_path
    assert len({RunDir(tmp_path).stage(n) for n in names}) == len(names)
    assert [s.name for s in STAGES if s.trains is not None] == ["pretrain", "sft", "dpo", "rl"]


def test_a_table_rejects_duplicates_and_upstreams_that_come_later():
    a, b = Stage("a", _noop, ()), Stage("b", _noop, (), upstream=("a",))
    with pytest.raises(ValueError, match="two stages named 'a'"):
        StageTable([a, a])
    with pytest.raises(ValueError, match=r"stage 'b': upstream \['a'\] must be earlier"):
        StageTable([b, a])
    with pytest.raises(ValueError, match="must be earlier"):
        STAGES.with_stage(dataclasses.replace(b, upstream=("nowhere",)))
    t = StageTable([a]).with_stage(b)
    assert t.names == ["a", "b"] and len(t) == 2 and list(t) == [a, b]


def test_with_stage_inserts_after_a_named_stage_and_leaves_the_table_as_it_was():
    extra = Stage("evaluate-checkpoints", _noop, ("evaluate",), upstream=("pretrain",))
    t = STAGES.with_stage(extra, after="pretrain")
    assert t.names.index("evaluate-checkpoints") == STAGES.names.index("pretrain") + 1
    assert "evaluate-checkpoints" not in STAGES
    with pytest.raises(OlmoflowError, match="unknown stage 'pretrian'; did you mean 'pretrain'"):
        STAGES.with_stage(extra, after="pretrian")


def test_enabled_follows_the_record():
    cfg = RunConfig()
    off = Stage("off", _noop, (), enabled=lambda c: c.seed == -1)
    t = STAGES.with_stage(off)
    assert not off.is_enabled(cfg) and "off" not in [s.name for s in t.enabled(cfg)]
    cfg.seed = -1
    assert off.is_enabled(cfg) and t.enabled(cfg)[-1] is off
