"""Task specs (``arc_easy:num_shots=0,formulation=mc``) and the ``evaluate`` config section that
holds them: parsed, canonical (one fingerprint however written), checked at load with one-line
errors naming the key and the closest valid name."""

from __future__ import annotations

from pathlib import Path

import pytest

from olmoflow.errors import OlmoflowError
from olmoflow.eval.registry import register_task, task_names
from olmoflow.eval.requests import LoglikelihoodRequest
from olmoflow.eval.spec import normalize, parse_spec, resolve, split_specs
from olmoflow.eval.task import EvalSettings, Task
from olmoflow.pipeline.config import load_config


@register_task
class SpecToy(Task):
    name = "h4_spec_toy"
    description = "a task of the spec tests"

    def load(self):
        return [0]

    def requests(self, doc):
        return [LoglikelihoodRequest("a", " b")]

    def score(self, doc, results):
        return {"acc_raw": 1.0}


def test_a_comma_list_splits_into_specs_and_options_stay_with_their_task():
    assert split_specs("arc_easy:num_shots=0,formulation=mc,hellaswag,piqa:limit=5") == [
        "arc_easy:num_shots=0,formulation=mc", "hellaswag", "piqa:limit=5"]
    assert split_specs(["a", "b:limit=3, seed=7", " c "]) == ["a", "b:limit=3,seed=7", "c"]
    with pytest.raises(OlmoflowError, match="comes before any task name"):
        split_specs("limit=3,arc_easy")


def test_options_are_typed_and_bad_ones_name_the_closest_option():
    s = parse_spec("winogrande:path=/data/wino_dev.jsonl,num_shots=0,strict=true,limit=20")
    assert dict(s.options) == {"path": Path("/data/wino_dev.jsonl"), "num_shots": 0,
                               "strict": True, "limit": 20}
    st = s.settings(EvalSettings(limit=100, seed=5))
    assert (st.limit, st.seed, st.num_shots, st.strict) == (20, 5, 0, True)
    with pytest.raises(OlmoflowError, match="unknown option 'lmit'; did you mean 'limit'"):
        parse_spec("arc_easy:lmit=3")
    with pytest.raises(OlmoflowError, match="num_shots='x' must be an integer"):
        parse_spec("arc_easy:num_shots=x")
    with pytest.raises(OlmoflowError, match="limit=0 must be >= 1"):
        parse_spec("arc_easy:limit=0")
    with pytest.raises(OlmoflowError, match="given twice"):
        parse_spec("arc_easy:limit=3,limit=4")
    with pytest.raises(OlmoflowError, match="not key=value"):
        parse_spec("arc_easy:limit")
    with pytest.raises(OlmoflowError, match="not a task name"):
        parse_spec("../etc:limit=3")


def test_equal_specs_written_two_ways_are_one_canonical_spec():
    assert normalize(["t:num_shots=0,formulation=mc", "t:formulation=mc,num_shots=0", "u"]) == [
        "t:formulation=mc,num_shots=0", "u"]


def test_resolve_expands_all_and_names_the_closest_task():
    every = resolve("all:limit=2")
    assert [r.name for r in every] == task_names() and "h4_spec_toy" in task_names()
    assert all(r.settings.limit == 2 for r in every)
    with pytest.raises(OlmoflowError, match="unknown task 'h4_spec_tyo'; did you mean "
                                            "'h4_spec_toy'"):
        resolve("h4_spec_tyo")
    # one task under two settings: each is labelled by its spec
    two = resolve("h4_spec_toy:limit=1,h4_spec_toy:limit=2")
    assert [r.label for r in two] == ["h4_spec_toy:limit=1", "h4_spec_toy:limit=2"]
    # a spec's option wins over the default
    (one,) = resolve("h4_spec_toy:seed=3", EvalSettings(limit=9, seed=1))
    assert (one.label, one.settings.limit, one.settings.seed) == ("h4_spec_toy", 9, 3)
    assert isinstance(one.task(), SpecToy) and one.task().settings == one.settings


def test_evaluate_section_is_checked_at_load_with_the_key_named():
    cfg = load_config("tiny", ["evaluate.tasks=[h4_spec_toy:seed=3,limit=2]",
                               "evaluate.checkpoints=[10, 20]", "evaluate.in_loop.interval=5",
                               "evaluate.in_loop.tasks=h4_spec_toy"])
    e = cfg.evaluate
    assert e.tasks == ["h4_spec_toy:limit=2,seed=3"] and e.checkpoints == "10,20"
    assert e.in_loop.interval == 5 and e.in_loop.tasks == ["h4_spec_toy"]
    assert e.in_loop.limit == 100 and e.in_loop.bpb is True
    assert load_config("tiny").evaluate.checkpoints == "latest"
    assert load_config("tiny", ["evaluate.tasks=[]"]).evaluate.tasks == []  # none, on purpose
    bad = {
        "evaluate.tasks=[h4_spec_tyo]": "evaluate.tasks: unknown task 'h4_spec_tyo'; did you "
                                        "mean 'h4_spec_toy'",
        "evaluate.in_loop.tasks=[h4_spec_toy:shots=1]": "evaluate.in_loop.tasks: task spec",
        "evaluate.checkpoints=best": "evaluate.checkpoints entry 'best'",
        "evaluate.in_loop.interval=-1": "evaluate.in_loop.interval=-1",
        "evaluate.in_loop.limit=0": "evaluate.in_loop.limit=0",
        "evaluate.limit=0": "evaluate.limit=0",
        "evaluate.in_loop.intervl=3": "did you mean 'evaluate.in_loop.interval'",
        "evaluate.allow_network=maybe": "evaluate.allow_network",
        "evaluate.tasks=,": "evaluate.tasks=[','] names no task",
        "evaluate.tasks=['']": "evaluate.tasks=[''] names no task",
        "evaluate.in_loop.tasks=' , '": "evaluate.in_loop.tasks=[' , '] names no task",
    }
    for override, fragment in bad.items():
        with pytest.raises(OlmoflowError) as e:
            load_config("tiny", [override])
        assert fragment in str(e.value) and "\n" not in str(e.value), override
