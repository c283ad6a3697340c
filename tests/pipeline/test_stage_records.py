"""Everything about a stage is in its record: no module outside the records keeps a table of stage
names, and the tables readers need (directories, the model chain, the data stages, the
post-training sections, the bookkeeping keys, what each model-reading stage reads) are derived
from the records."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import olmoflow
from olmoflow.pipeline.config import finetune_sections, load_config
from olmoflow.pipeline.models import (
    final_model_stage,
    first_model_stage,
    model_chain,
    model_read_by,
    previous_model_stage,
)
from olmoflow.pipeline.stage import FINAL_MODEL, FIRST_MODEL, PREVIOUS_MODEL, Stage, StageTable
from olmoflow.pipeline.stages import STAGES
from olmoflow.pipeline.stages.posttrain import posttrain_stage
from olmoflow.pipeline.stages.train import TRAIN_BOOKKEEPING
from olmoflow.run_dir import Makes, RunDir
from olmoflow.train.config import BOOKKEEPING_KEYS, bookkeeping_keys

SRC = Path(olmoflow.__file__).resolve().parent


def _noop(cfg, progress):
    raise AssertionError("not run in these tests")


def _is_stage_call(node: ast.AST | None) -> bool:
    return (isinstance(node, ast.Call) and
            getattr(node.func, "id", getattr(node.func, "attr", None)) == "Stage")


def _names_a_stage(node: ast.AST) -> bool:
    """A variable that holds a stage name (``stage``, ``name``, ``self.stage``)."""
    word = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return "stage" in word.lower() or word == "name"


def stage_name_tables(source: str, names: set[str]) -> list[str]:
    """Where ``source`` spells stage names outside a record: a tuple, list, set or dict literal
    holding two or more of ``names`` that is not an argument of a ``Stage(...)`` call (a stage's
    own upstream), a comparison of a stage variable with a stage name (``stage == "pretrain"``),
    or a module constant set to one (``TRAINING_STAGE = "pretrain"``)."""
    tree = ast.parse(source)
    parent = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict):
            elts = node.keys if isinstance(node, ast.Dict) else node.elts
            hit = sorted({e.value for e in elts if isinstance(e, ast.Constant)
                          and e.value in names})
            up = parent.get(node)
            if isinstance(up, ast.keyword):
                up = parent.get(up)
            if len(hit) >= 2 and not _is_stage_call(up):
                found.append(f"line {node.lineno}: a table of {hit}")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_names_a_stage(o) for o in operands):
                found += [f"line {node.lineno}: compares with '{o.value}'" for o in operands
                          if isinstance(o, ast.Constant) and o.value in names]
    for node in tree.body:
        value = getattr(node, "value", None)
        if (isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(value, ast.Constant)
                and value.value in names):
            found.append(f"line {node.lineno}: a constant '{value.value}'")
    return found


def test_no_module_outside_the_records_spells_a_table_of_stage_names():
    names = set(STAGES.names)
    found = {str(p.relative_to(SRC)): hits for p in sorted(SRC.rglob("*.py"))
             if (hits := stage_name_tables(p.read_text(encoding="utf-8"), names))}
    assert found == {}


@pytest.mark.parametrize("source", [
    'MODEL_STAGES = ("pretrain", "sft", "dpo", "rl")',
    'DIRS = {"collect": "collect", "tokenize": "tokens"}',
    'def f(stage):\n    return stage == "pretrain"',
    'TRAINING_STAGE = "pretrain"',
    'for s in ["sft", "dpo"]:\n    pass',
])
def test_the_scan_finds_the_tables_it_forbids(source):
    assert stage_name_tables(source, set(STAGES.names))


def test_a_stage_s_own_upstream_is_no_table():
    source = 'X = Stage("tokenize", run, ("tokenize",), ("clean", "train-tokenizer"))\n'
    assert stage_name_tables(source, set(STAGES.names)) == []


def test_directories_come_from_the_records(tmp_path):
    dirs = {s.name: s.dirname for s in STAGES if s.dirname != s.name}
    assert dirs == {"train-tokenizer": "tokenizer", "tokenize": "tokens", "evaluate": "eval"}
    for s in STAGES:
        assert RunDir(tmp_path).stage(s.name) == tmp_path / s.dirname


def test_the_model_chain_is_the_stages_that_make_a_model():
    assert [s.name for s in STAGES.models()] == ["pretrain", "sft", "dpo", "rl"]
    assert [s.name for s in STAGES if s.trains is not None] == [s.name for s in STAGES.models()]
    keys = {s.name: s.makes.sequence_length for s in STAGES.models()}
    assert keys == {"pretrain": "train.sequence_length", "sft": "sft.train.sequence_length",
                    "dpo": "dpo.train.sequence_length", "rl": None}
    assert [s.name for s in STAGES.models() if s.makes.own_tokenizer] == ["sft", "dpo", "rl"]


def test_the_chain_follows_the_config():
    cfg = load_config("tiny")
    assert [s.name for s in model_chain(cfg)] == ["pretrain"]
    assert first_model_stage(cfg) == final_model_stage(cfg) == "pretrain"
    assert model_read_by(cfg, "release") == "pretrain"
    cfg = load_config("tiny", ["sft.data.paths=[a.jsonl]", "dpo.data.paths=[b.jsonl]"])
    assert [s.name for s in model_chain(cfg)] == ["pretrain", "sft", "dpo"]
    assert final_model_stage(cfg) == model_read_by(cfg, "release") == "dpo"
    # evaluate and generate read the pretrained model (raw text, held-out bits-per-byte)
    assert model_read_by(cfg, "evaluate") == model_read_by(cfg, "generate") == "pretrain"
    assert model_read_by(cfg, "dpo") == previous_model_stage(cfg, "dpo") == "sft"
    with pytest.raises(ValueError, match="reads no model"):
        model_read_by(cfg, "tokenize")


def test_a_model_reading_stage_gets_the_model_stages_as_upstream():
    up = {s.name: s.upstream for s in STAGES if s.reads}
    assert up == {"sft": ("pretrain",), "dpo": ("pretrain", "sft"),
                  "rl": ("pretrain", "sft", "dpo"), "evaluate": ("pretrain",),
                  "generate": ("pretrain",),
                  "release": ("pretrain", "sft", "dpo", "rl", "evaluate")}
    assert {s.name: s.reads for s in STAGES if s.reads} == {
        "sft": PREVIOUS_MODEL, "dpo": PREVIOUS_MODEL, "rl": PREVIOUS_MODEL,
        "evaluate": FIRST_MODEL, "generate": FIRST_MODEL, "release": FINAL_MODEL}


def test_a_new_post_training_stage_is_one_row():
    """A stage the factory makes joins the chain, the release's upstream and the readers'
    directories without another table changing."""
    kto = posttrain_stage("kto", _noop, "kto", ("steps",))
    table = STAGES.with_stage(kto, after="rl")
    assert [s.name for s in table.models()] == ["pretrain", "sft", "dpo", "rl", "kto"]
    assert table["kto"].upstream == ("pretrain", "sft", "dpo", "rl")
    assert "kto" in table["release"].upstream
    assert table["kto"].makes == Makes(sequence_length="kto.train.sequence_length",
                                       data="kto.data", own_tokenizer=True)
    assert table["kto"].ignore == bookkeeping_keys("kto.train")
    assert table["kto"].trains.resume_key == "kto.train.checkpoint.resume_from"


def test_reads_is_checked_where_the_table_is_made():
    maker = Stage("m", _noop, (), makes=Makes())
    with pytest.raises(ValueError, match="no earlier stage makes a model"):
        StageTable([Stage("r", _noop, (), reads=FINAL_MODEL), maker])
    with pytest.raises(ValueError, match="reads='the best model'"):
        StageTable([maker, Stage("r", _noop, (), reads="the best model")])


def test_the_data_stages_are_what_the_pretrained_model_is_made_from():
    assert STAGES.ancestors("pretrain") == ["collect", "clean", "train-tokenizer", "tokenize"]


def test_the_post_training_sections_are_the_post_training_stages():
    assert finetune_sections() == [s.name for s in STAGES if s.reads == PREVIOUS_MODEL]


def test_the_bookkeeping_keys_are_one_list():
    assert TRAIN_BOOKKEEPING == tuple(f"train.{k}" for k in BOOKKEEPING_KEYS)
    for s in STAGES:
        if s.trains is not None and s.name != "pretrain":
            assert s.ignore == bookkeeping_keys(f"{s.name}.train")
