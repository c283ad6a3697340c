"""The data engine's config (``olmoflow.data.config``): every bad value is refused when the
config loads, or before the first step runs, with one line naming the key, exit 2; good values
still load."""

from __future__ import annotations

import json
import math
import pickle
import re
from pathlib import Path

import pytest
import yaml
from checks import one_line_error
from engine_inputs import engine_config
from fuzzing import CASES, Findings, good_docs, mutated_yaml, rng_for
from test_cli import assert_one_line_error, cli

from olmoflow.cli import main
from olmoflow.config import from_dict
from olmoflow.data.config import load_data_config
from olmoflow.data.decontam import DecontamConfig
from olmoflow.data.dedup import DedupConfig, MinHashConfig, run_dedup
from olmoflow.data.engine import Engine
from olmoflow.data.mixer import MixConfig, mix
from olmoflow.data.rules import Rule
from olmoflow.data.sources import SourceOptions, ingest_tasks
from olmoflow.errors import OlmoflowError


def _one_line_exit_2(capsys, argv, *needles):
    rc, _, err = cli(capsys, *argv)
    assert_one_line_error(rc, err, *needles)


def _data_yaml(tmp_path, source: str, extra: str = "") -> str:
    path = tmp_path / "data.yaml"
    path.write_text(f"output: {tmp_path / 'engine'}\nexecutor: serial\nsteps: [ingest]\n"
                    f"sources: [{source}]\n{extra}")
    return str(path)


BAD_DATA = [
    ("{name: " + "s" * 256 + ", paths: [x]}", "", "sources[0].name"),
    ("{name: " + "é" * 128 + ", paths: [x]}", "", "sources[0].name"),  # 256 bytes
    ("{name: web, paths: [x], options: {max_shard_bytes: big}}", "",
     "sources[0].options.max_shard_bytes"),
    ("{name: web, paths: [x], options: {max_shard_bytes: 1.5}}", "",
     "sources[0].options.max_shard_bytes"),
    ("{name: web, paths: [x], options: {max_document_bytes: " + "9" * 40 + "}}", "",
     "sources[0].options.max_document_bytes"),
    ("{name: web, paths: [x], options: {max_document_bytes: [1]}}", "",
     "sources[0].options.max_document_bytes"),
    ("{name: web, paths: [x], options: {text_field: 3}}", "", "sources[0].options.text_field"),
    ("{name: web, paths: [x], options: {strict: 'yes'}}", "", "sources[0].options.strict"),
    ("{name: web, paths: [x], options: {follow_symlinks: 1}}", "",
     "sources[0].options.follow_symlinks"),
    ("{name: web, paths: [x], options: {html_extractor: [a]}}", "",
     "sources[0].options.html_extractor"),
    ("{name: web, paths: [x], options: {1: 2}}", "", "sources[0].options"),
    ("{name: web, paths: [x]}", "dedup: {1: 2}\n", "dedup"),
    ("{name: web, paths: [x]}", "mixer: {a: [{null: 1}]}\n", "mixer"),
    ("{name: web, paths: [x]}", "taggers: [{1: 2, name: x}]\n", "taggers"),
    ("{name: web, paths: [x]}", "quality: {options: {1.5: 2}}\n", "quality.options"),
    ("{name: web, paths: [x]}", "dedup: {min_paragraph_chars: x}\n",
     "dedup.min_paragraph_chars"),
    ("{name: web, paths: [x]}", "dedup: {exact: 'yes'}\n", "dedup.exact"),
    ("{name: web, paths: [x]}", "dedup: {minhash: {seed: " + "9" * 30 + "}}\n",
     "dedup.minhash.seed"),
    ("{name: web, paths: [x]}", "decontaminate: {ngram: x}\n", "decontaminate.ngram"),
    ("{name: web, paths: [x]}", "mixer: {seed: 1.5}\n", "mixer.seed"),
    ("{name: web, paths: [x]}", "mixer: {max_bytes: [1]}\n", "mixer.max_bytes"),
    ("{name: web, paths: [x]}", "tokenize: {min_frequency: -1}\n", "tokenize.min_frequency"),
    ("{name: web, paths: [x]}", "tokenize: {vocab_size: 0}\n", "tokenize.vocab_size"),
    ("{name: web, paths: [x]}", "tokenize: {heldout_fraction: .nan}\n",
     "tokenize.heldout_fraction"),
    ("{name: web, paths: [x]}", "tokenize: {heldout_max_documents: -1}\n",
     "tokenize.heldout_max_documents"),
]


@pytest.mark.parametrize("source,extra,key", BAD_DATA)
def test_a_bad_data_engine_value_is_refused_at_load(source, extra, key, tmp_path):
    with pytest.raises(OlmoflowError, match=key.replace(".", r"\.").replace("[", r"\[")):
        load_data_config(_data_yaml(tmp_path, source, extra))


@pytest.mark.parametrize("extra", ["dedup: {minhash: true, exact: false}\n",
                                   "dedup: {minhash: {threshold: 0.5, seed: 7}}\n",
                                   "mixer: {seed: 3, max_bytes: null}\n",
                                   "decontaminate: {ngram: 8}\n"])
def test_good_data_engine_values_still_load(extra, tmp_path):
    load_data_config(_data_yaml(tmp_path, "{name: web, paths: [x]}", extra))


def test_a_255_byte_source_name_loads(tmp_path):
    cfg = load_data_config(_data_yaml(tmp_path, "{name: " + "s" * 255 + ", paths: [x]}"))
    assert len(cfg.sources[0].name) == 255


@pytest.mark.parametrize("i", [0, 4, 10, 13])
def test_cli_bad_data_engine_value_is_one_line_exit_2(i, tmp_path, capsys):
    source, extra, key = BAD_DATA[i]
    _one_line_exit_2(capsys, ["data", "ingest", _data_yaml(tmp_path, source, extra),
                              "--no-progress"], key)
    assert not (tmp_path / "engine").exists()


# --- every section typed, parsed once by olmoflow.config.from_dict -----------------------------


def _config(tmp_path, **sections) -> str:
    path = tmp_path / "data.yaml"
    path.write_text(yaml.safe_dump({"output": str(tmp_path / "run"),
                                    "sources": [{"name": "web", "paths": ["x"]}], **sections}))
    return str(path)


def test_sections_are_typed_when_the_config_loads(tmp_path):
    cfg = load_data_config(_config(
        tmp_path, dedup={"minhash": True, "paragraphs": True},
        decontaminate={"ngram": 8, "evals": "gsm8k"},
        mixer={"exclude": "gopher__fail == 1", "weights": {"web": 2}},
        sources=[{"name": "web", "paths": ["x"], "options": {"max_shard_bytes": 400}}]))
    assert cfg.dedup == DedupConfig(paragraphs=True, minhash=MinHashConfig())
    assert cfg.decontaminate.evals == ["gsm8k"] and cfg.decontaminate.ngram == 8
    assert cfg.mixer.exclude == [Rule("gopher__fail", "==", 1.0)]
    assert cfg.mixer.weights == {"web": 2.0} and cfg.mixer.attributes is None
    assert cfg.sources[0].options == SourceOptions(max_shard_bytes=400)
    # The saved config (config.yaml) loads back to the same sections.
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(cfg.to_dict()))
    assert load_data_config(again) == cfg


@pytest.mark.parametrize("sections, message", [
    # Unknown source options were left to ingest, found only when its step ran.
    ({"sources": [{"name": "web", "paths": ["x"], "options": {"text_feild": "body"}}]},
     "unknown config key 'sources[0].options.text_feild'; did you mean "
     "'sources[0].options.text_field'?"),
    ({"sources": [{"name": "web", "paths": ["x"], "options": {"max_shard_bytes": 0}}]},
     "sources[0].options.max_shard_bytes must be in [1, 2**63), got 0"),
    ({"sources": [{"name": "web", "paths": ["x"], "options": {"html_extractor": "trafilatora"}}]},
     "sources[0].options.html_extractor: unknown html_extractor 'trafilatora'; did you mean "
     "'trafilatura'?"),
    # Range checks of the dedup, decontaminate and mixer sections: at load, with the full key.
    ({"dedup": {"minhash": {"threshold": 0}}}, "dedup.minhash.threshold must be in (0, 1]"),
    ({"dedup": {"minhash": {"bands": 4}}}, "dedup.minhash: give both bands and rows"),
    ({"decontaminate": {"action": "dorp"}},
     "decontaminate.action: unknown action 'dorp'; did you mean 'drop'?"),
    ({"mixer": {"weights": {"web": -1}}}, "mixer.weights.web must be a number >= 0, got -1"),
    ({"mixer": {"max_documents": 0}}, "mixer.max_documents must be a positive integer, got 0"),
    ({"mixer": {"include": ["a = 1"]}}, "mixer.include[0]: cannot parse rule 'a = 1'"),
    ({"mixer": {"max_bytes": 2**70}}, "mixer.max_bytes does not fit in 64 bits"),
])
def test_a_bad_section_value_is_one_line_naming_its_key(tmp_path, sections, message):
    with pytest.raises(OlmoflowError) as e:
        load_data_config(_config(tmp_path, **sections))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_shard_tasks_carry_the_section_dataclass(tmp_path):
    # The jobs read the section they are handed; nothing parses a mapping again in a worker.
    from olmoflow.data.documents import write_documents

    docs = tmp_path / "documents" / "web"
    docs.mkdir(parents=True)
    write_documents(docs / "a.jsonl.gz", [{"id": f"d{i}", "text": "same text", "source": "web"}
                                          for i in range(3)])
    seen: dict[str, list] = {}

    def run_jobs(step, fn, tasks, **kw):
        seen.setdefault(step, []).extend(tasks)
        return [fn(t) for t in tasks]

    run_dedup({"exact": True}, [{"input": str(docs / "a.jsonl.gz"),
                                 "output": str(tmp_path / "attributes" / "dedup" / "web" /
                                               "a.jsonl.gz")}], tmp_path, run_jobs)
    mix(tmp_path, {"attributes": ["dedup"], "exclude": ["dedup__exact == 1"]}, run_jobs=run_jobs)
    assert all(isinstance(t["config"], DedupConfig) for t in seen["dedup"])
    assert all(isinstance(t["config"], MixConfig) for t in seen["mix"])
    tasks = ingest_tasks("web", [str(docs)], tmp_path / "out", options={"text_field": "body"})
    assert tasks[0]["options"] == SourceOptions(text_field="body")
    for t in seen["dedup"] + seen["mix"] + tasks:  # the process pool and Ray pickle them
        assert pickle.loads(pickle.dumps(t)) == t


def test_library_callers_get_the_same_parser():
    with pytest.raises(OlmoflowError, match="did you mean 'decontaminate.evals'"):
        from_dict(DecontamConfig, {"eval": ["arc"]}, "decontaminate.")
    assert from_dict(DedupConfig, {"minhash": False}, "dedup.").minhash is None


@pytest.mark.parametrize("override, message", [
    ("mixer.exclud=[]", "unknown config key 'mixer.exclud'; did you mean 'mixer.exclude'?"),
    ("mixer.exclude=['gopher__fail_any = 1']", "cannot parse rule"),
    ("mixer.weights={webb: 2}", "unknown source 'webb'; did you mean 'web'?"),
    ("dedup.exakt=true", "unknown config key 'dedup.exakt'; did you mean 'dedup.exact'?"),
    ("decontaminate.evals=[arcc]", "did you mean 'arc'?"),
    ("taggers=[pii, gopherr]", "unknown tagger 'gopherr'; did you mean 'gopher'?"),
    ("dedup.minhash.threshold=abc", "dedup.minhash.threshold' expects float, got 'abc'"),
    ("tokenize.dtype=uint8", "unknown tokenize.dtype 'uint8'"),
    ("tokenize.tokenizer=/no/such/tokenizer", "no such directory '/no/such/tokenizer'"),
    ("quality.labeled=[/no/such/labels.jsonl]", "'/no/such/labels.jsonl' matches no file"),
])
def test_config_mistakes_stop_the_run_before_the_first_step(tmp_path, override, message):
    # A typo in the mixer (or dedup, decontamination, taggers) was reported only when its step
    # came, after ingest and tagging had run: hours, on a real corpus.
    steps = "[ingest, tag, dedup, decontaminate, mix, tokenize]"
    with pytest.raises(OlmoflowError, match=re.escape(message)):  # at load, or before ingest
        Engine(load_data_config(engine_config(tmp_path, steps=steps), [override])).run()
    assert not (tmp_path / "run" / "documents").exists()


# --- tagger and quality-training option values, at load -------------------------------------------


def _doc(text: str) -> str:
    return json.dumps({"text": text}) + "\n"


@pytest.fixture
def source_dir(tmp_path) -> Path:
    """``data/`` with one JSONL file: the source of the configs below."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text(_doc("inside a " * 10))
    return tmp_path


def _source_config(tmp: Path, extra: str = "", follow: bool = False) -> Path:
    opts = ", options: {follow_symlinks: true}" if follow else ""
    cfg = tmp / "data.yaml"
    cfg.write_text(f"output: {tmp / 'engine'}\nexecutor: serial\nsteps: [ingest]\n"
                   f"sources: [{{name: web, paths: ['{tmp / 'data'}']{opts}}}]\n{extra}")
    return cfg


@pytest.mark.parametrize("extra,fragment", [
    ("taggers: [{gopher: {min_doc_words: many}}]", "taggers[0].gopher.min_doc_words"),
    ("taggers: [{gopher: {quality: 1}}]", "expects true or false"),
    ("taggers: [c4, {code_secrets: {min_entropy: .nan}}]", "taggers[1].code_secrets.min_entropy"),
    ("taggers: [{langid: {languages: en}}]", "taggers[0].langid.languages"),
    ("taggers: [{langid: {languages: [1]}}]", "taggers[0].langid.languages"),
    ("taggers: [{gopher: {top_n_grams: [[2, x]]}}]", "taggers[0].gopher.top_n_grams"),
    ("taggers: [{gopher: {min_doc_word: 5}}]", "did you mean 'min_doc_words'"),
    ("taggers: [{quality: {model: 5}}]", "taggers[0].quality.model"),
    ("taggers: [{gopher: [1]}]", "options of tagger 'gopher' must be a mapping"),
    ("quality: {options: {lr: -1}}", "quality.options.lr"),
    ("quality: {options: {epoch: 0}}", "quality.options.epoch"),
    ("quality: {options: {dim: 1.5}}", "quality.options.dim"),
    ("quality: {options: {heldout_fraction: .nan}}", "heldout_fraction must be in (0, 1)"),
    ("quality: {options: {epochz: 3}}", "did you mean 'epoch'"),
    ("quality: {options: {text_field: 3}}", "quality.options.text_field"),
])
def test_bad_option_values_are_refused_when_the_config_loads(source_dir, extra, fragment):
    with pytest.raises(OlmoflowError) as e:
        load_data_config(_source_config(source_dir, extra))
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_good_option_values_load(source_dir):
    cfg = load_data_config(_source_config(source_dir,
                                          "taggers: [{gopher: {min_doc_words: 10, "
                                          "top_n_grams: [[2, 0.3]], max_symbol_word_ratio: 1}},"
                                          " {langid: {languages: [en, de]}}, my_plugin_tagger]\n"
                                          "quality: {options: {lr: 0.5, epoch: 3}}"))
    assert cfg.taggers[0]["gopher"]["min_doc_words"] == 10
    assert math.isclose(cfg.quality.options["lr"], 0.5)


def test_a_bad_tagger_option_stops_the_run_before_ingest(source_dir, capsys):
    cfg = _source_config(source_dir, "taggers: [{pii: {nope: 1}}]")
    cfg.write_text(cfg.read_text().replace("steps: [ingest]", "steps: [ingest, tag]"))
    assert main(["data", "run", str(cfg), "--no-progress"]) == 2
    assert "option of tagger 'pii'" in one_line_error(capsys)
    assert not (source_dir / "engine").exists()  # refused before anything was made


# --- seeded fuzzing (tests/fuzzing.py): data-engine configs ---------------------------------------


DATA_CONFIG = """\
output: {out}
executor: serial
workers: 1
strict: false
steps: [ingest, tag, dedup, decontaminate, mix, tokenize]
sources:
  - name: web
    paths: [{data}]
    options: {{text_field: text}}
quality:
  options: {{epoch: 5}}
taggers: [gopher, c4, {{langid: {{languages: [en]}}}}, pii]
dedup:
  exact: true
  key: metadata.url
  paragraphs: true
  minhash: {{threshold: 0.8, ngram: 5, num_perm: 16, seed: 1}}
decontaminate:
  ngram: 13
  evals: [arc]
  eval_dir: {evals}
  action: drop
mixer:
  exclude: ["gopher__fail_any == 1"]
  replace: {{pii__email_address: "|||EMAIL|||"}}
  seed: 0
tokenize:
  tokenizer: null
  vocab_size: 300
  dtype: auto
"""


def test_fuzz_data_engine_configs(tmp_path):
    """Mutated data-engine configs, loaded and checked the way ``olmoflow data run`` does before
    any step runs (nothing is ingested)."""
    from olmoflow.data.engine import Engine, load_data_config

    r, found = rng_for("data-config"), Findings("data-engine config")
    data = tmp_path / "web.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in good_docs(r)))
    (tmp_path / "evals").mkdir()
    base = DATA_CONFIG.format(out=tmp_path / "engine", data=data, evals=tmp_path / "evals")

    def load(path: Path) -> None:
        cfg = load_data_config(path)
        engine = Engine(cfg)
        engine.preflight()

    for case in range(CASES):
        path = tmp_path / f"case{case:04d}.yaml"
        path.write_bytes(mutated_yaml(r, base))
        found.outcome(case, path.read_bytes()[:600].decode("utf-8", "replace"),
                      lambda path=path: load(path))
    assert not (tmp_path / "engine").exists()  # checking a config makes nothing
    found.check()
