"""The config mechanism (``olmoflow.config``): one parser for run configs and data-engine
configs. Bad configs, YAML files and overrides are refused at load with one line naming the key
or file, exit 2: never a traceback later, never a run that is silently wrong."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from fuzzing import CASES, OVERRIDE_VALUES, ROOT, Findings, mutated_yaml, rng_for
from test_cli import assert_one_line_error, cli

from olmoflow.config import all_keys, from_dict, load_tree, note_renamed
from olmoflow.data.config import load_data_config
from olmoflow.errors import OlmoflowError
from olmoflow.pipeline.config import load_config


@dataclass
class Inner:
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])


@dataclass
class Legacy:
    """A section that still reads its old flat spelling ``learning_rate``."""

    inner: Inner = field(default_factory=Inner)
    steps: int = 10
    name: str | None = None

    @classmethod
    def upgrade_keys(cls, data: dict, prefix: str) -> dict:
        if "learning_rate" in data:
            note_renamed(f"{prefix}learning_rate", f"{prefix}inner.lr")
            data.setdefault("inner", {})["lr"] = data.pop("learning_rate")
        return data


@dataclass
class Root:
    legacy: Legacy = field(default_factory=Legacy)
    seed: int = 0


def test_nested_sections_and_types():
    cfg = from_dict(Root, {"legacy": {"inner": {"lr": 1, "betas": [0.8, 0.9]}, "steps": 3}})
    assert cfg.legacy.inner.lr == 1.0 and isinstance(cfg.legacy.inner.lr, float)
    assert cfg.legacy.inner.betas == [0.8, 0.9] and cfg.legacy.steps == 3
    assert from_dict(Root, {"legacy": {"inner": {"lr": "1e-3"}}}).legacy.inner.lr == 1e-3
    assert all_keys(Root) == ["legacy.inner.lr", "legacy.inner.betas", "legacy.steps",
                              "legacy.name", "seed"]


@pytest.mark.parametrize("tree, message", [
    ({"legacy": {"stepz": 1}}, "unknown config key 'legacy.stepz'; did you mean 'legacy.steps'?"),
    ({"legacyy": {"steps": 1}}, "unknown config key 'legacyy.steps'; did you mean 'legacy.steps'?"),
    ({"legacy": {"inner": {"lrr": 1}}}, "did you mean 'legacy.inner.lr'?"),
    ({"legacy": {"steps": "ten"}}, "config key 'legacy.steps' expects int, got 'ten'"),
    ({"legacy": {"steps": True}}, "config key 'legacy.steps' expects int"),
    ({"legacy": None}, "config section 'legacy' is empty"),
    ({"legacy": [1]}, "config section 'legacy' must be a mapping"),
    ({"legacy": {"inner": {"betas": {"a": 1}}}}, "expects a list"),
])
def test_bad_keys_and_values_are_one_line_errors(tree, message):
    with pytest.raises(OlmoflowError) as e:
        from_dict(Root, tree)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_old_spelling_is_upgraded_with_one_note(capsys):
    cfg = from_dict(Root, {"legacy": {"learning_rate": 0.5}})
    assert cfg.legacy.inner.lr == 0.5
    err = capsys.readouterr().err
    assert "config key 'legacy.learning_rate' is now 'legacy.inner.lr'" in err
    from_dict(Root, {"legacy": {"learning_rate": 0.5}})
    assert capsys.readouterr().err == ""  # once per process


def test_overrides_and_values_apply_in_order(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("legacy:\n  steps: 1\n")
    tree = load_tree(str(path), ["legacy.steps=2", "legacy.inner={lr: 0.1}"], {"legacy.steps": 3})
    assert tree == {"legacy": {"steps": 3, "inner": {"lr": 0.1}}}


def test_invalid_yaml_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("legacy:\n  steps: 1\n   x: [\n")
    with pytest.raises(OlmoflowError, match=r"bad.yaml:\d+: invalid YAML"):
        load_tree(str(path))


def test_a_new_spelling_given_later_wins_over_an_old_one(tmp_path, capsys):
    """An old-style file still takes new-style overrides, and the later of two spellings of one key
    wins: each source is upgraded before it is merged."""
    path = tmp_path / "old.yaml"
    path.write_text("legacy:\n  learning_rate: 0.1\n")
    tree = load_tree(str(path), ["legacy.inner.lr=0.2"], schema=Root)
    assert from_dict(Root, tree).legacy.inner.lr == 0.2
    tree = load_tree(None, ["legacy.inner.lr=0.3", "legacy.learning_rate=0.4"], schema=Root)
    assert from_dict(Root, tree).legacy.inner.lr == 0.4
    tree = load_tree(None, ["legacy.learning_rate=0.4", "legacy.inner.lr=0.3"], schema=Root)
    assert from_dict(Root, tree).legacy.inner.lr == 0.3


def test_rename_notes_are_printed_on_rank_zero_only(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    note_renamed("a.only_on_rank_zero", "a.b")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    note_renamed("a.only_on_rank_zero_too", "a.b")
    assert "a.only_on_rank_zero_too" in capsys.readouterr().err


# --- run configs and YAML files: refused at load, one line, exit 2 ------------------------------

BAD_OVERRIDES = [
    ("model.n_kv_heads=0", "model.n_kv_heads"),
    ("model.n_kv_heads=-2", "model.n_kv_heads"),
    ("model.vocab_pad_multiple=0", "model.vocab_pad_multiple"),
    ("model.full_attention_every=0", "model.full_attention_every"),
    ("model.head_dim=-4", "model.head_dim"),
    ("model.dropout=2", "model.dropout"),
    ("model.dropout=1", "model.dropout"),
    ("model.dropout=-0.1", "model.dropout"),
    ("model.dropout=.nan", "model.dropout"),
    ("model.rope_theta=.nan", "model.rope_theta"),
    ("model.rope_theta=.inf", "model.rope_theta"),
    ("model.rope_theta=0", "model.rope_theta"),
    ("model.rms_norm_eps=-1", "model.rms_norm_eps"),
    ("model.rms_norm_eps=0", "model.rms_norm_eps"),
    ("model.rms_norm_eps=.nan", "model.rms_norm_eps"),
    ("tokenizer.min_frequency=-1", "tokenizer.min_frequency"),
]


@pytest.mark.parametrize("override,key", BAD_OVERRIDES)
def test_a_bad_override_is_refused_at_load(override, key):
    with pytest.raises(OlmoflowError, match=key.replace(".", r"\.")):
        load_config("tiny", [override])


@pytest.mark.parametrize("override", ["model.dropout=0.1", "model.rms_norm_eps=1e-5",
                                      "model.n_kv_heads=1", "tokenizer.min_frequency=0"])
def test_good_values_still_load(override):
    load_config("tiny", [override])


def _one_line_exit_2(capsys, argv, *needles):
    rc, _, err = cli(capsys, *argv)
    assert_one_line_error(rc, err, *needles)


@pytest.mark.parametrize("override,key", [BAD_OVERRIDES[0], BAD_OVERRIDES[9],
                                          BAD_OVERRIDES[-1]])
def test_cli_bad_override_is_one_line_exit_2(override, key, tmp_path, capsys):
    _one_line_exit_2(capsys, ["pretrain", "tiny", "--run-dir", str(tmp_path / "run"), override],
                     key)
    assert not (tmp_path / "run").exists()


YAML_FILES = {
    "invalid_utf8": (b"train:\n  max_steps: 3 \xff\xfe\n", "cannot read"),
    "int_key": (b"1: 2\n", "unknown config key '1'"),
    "nested_int_key": (b"model:\n  1: 2\n", "unknown config key 'model.1'"),
    "deep_flow": (b"a: " + b"[" * 10_000 + b"]" * 10_000 + b"\n", "nested too deeply"),
    "deep_block": (b"".join(b"  " * i + b"k%d:\n" % i for i in range(10_000))
                   + b"  " * 10_000 + b"x: 1\n", "nested too deeply"),
}


@pytest.mark.parametrize("name", sorted(YAML_FILES))
@pytest.mark.parametrize("loader", [load_config, load_data_config])
def test_a_bad_yaml_file_is_refused(name, loader, tmp_path):
    text, needle = YAML_FILES[name]
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(text)
    with pytest.raises(OlmoflowError, match=needle) as e:
        loader(str(path))
    assert "\n" not in str(e.value)
    if "nested" not in name and "int_key" not in name:
        assert str(path) in str(e.value)


@pytest.mark.parametrize("name", ["deep_flow", "invalid_utf8"])
def test_cli_bad_yaml_is_one_line_exit_2(name, tmp_path, capsys):
    text, needle = YAML_FILES[name]
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(text)
    _one_line_exit_2(capsys, ["pretrain", str(path), "--run-dir", str(tmp_path / "run")],
                     str(path), needle)
    _one_line_exit_2(capsys, ["data", "ingest", str(path), "--no-progress"], str(path), needle)


def test_a_deep_override_value_is_refused():
    with pytest.raises(OlmoflowError, match="override 'train.data': .*nested too deeply"):
        load_config("tiny", ["train.data=" + "[" * 10_000 + "]" * 10_000])

def test_yaml_values_users_write(tmp_path):
    with pytest.raises(OlmoflowError, match="run_dir is empty"):
        load_config("tiny", ["run_dir=''"])
    cfg = load_config("tiny", ["train.optimizer.lr=1e-3", "train={max_steps: 7}"])
    assert cfg.train.optimizer.lr == 1e-3
    assert cfg.train.max_steps == 7 and cfg.train.sequence_length == 64  # merged, not replaced
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(OlmoflowError, match="top level must be a mapping"):
        load_config(str(bad))
    for text, kind in (("[]\n", "list"), ("0\n", "int"), ("false\n", "bool"), ("''\n", "str")):
        bad.write_text(text)  # falsy, but still not a mapping of sections
        with pytest.raises(OlmoflowError, match=f"top level must be a mapping of sections, got "
                                                f"a {kind}"):
            load_config(str(bad))
    bad.write_text("# only a comment\n")
    assert load_config(str(bad)).train.max_steps == load_config(None).train.max_steps


# --- seeded fuzzing (tests/fuzzing.py): run configs and overrides ---------------------------------


def test_fuzz_run_config_files(tmp_path):
    """Mutations of configs/tiny.yaml loaded the way every run verb loads its config."""
    from olmoflow.pipeline.config import RunConfig, load_config

    r, found = rng_for("yaml"), Findings("run config")
    base = (ROOT / "configs" / "tiny.yaml").read_text()
    for case in range(CASES):
        path = tmp_path / f"case{case:04d}.yaml"
        path.write_bytes(mutated_yaml(r, base))
        kind, cfg = found.outcome(case, path.read_bytes()[:400].decode("utf-8", "replace"),
                                  lambda path=path: load_config(str(path)))
        if kind == "ok" and not isinstance(cfg, RunConfig):
            found.add(case, str(path), f"loaded as {type(cfg)}")
    found.check()


def test_fuzz_overrides(tmp_path):
    """``key=value`` overrides: real keys of the schema (and near misses) with values of every
    wrong type and range."""
    from olmoflow.config import all_keys
    from olmoflow.pipeline.config import RunConfig, load_config

    r, found = rng_for("overrides"), Findings("overrides")
    keys = all_keys(RunConfig) + ["resume_from", "model.d_modell", "train", "model", "", ".",
                                  "model..d_model", "train.optimizer", "1", "model.1"]
    for case in range(CASES):
        overrides = [f"{r.choice(keys)}={r.choice(OVERRIDE_VALUES)}"
                     for _ in range(r.randrange(1, 4))]
        kind, cfg = found.outcome(case, repr(overrides), lambda o=overrides: load_config("tiny", o))
        if kind == "ok" and not isinstance(cfg, RunConfig):
            found.add(case, repr(overrides), f"loaded as {type(cfg)}")
    found.check()
