"""The data engine's config, parallel tokenization and step runner (resume, skip, accounting)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from engine_inputs import engine_config, jsonl, shouting_plugin

from olmoflow.data.documents import write_documents
from olmoflow.data.engine import Engine, load_data_config
from olmoflow.data.executor import run_shards
from olmoflow.data.tokenize import (
    SPLITS,
    check_token_dir,
    open_token_dir,
    read_index,
    read_token_array,
    write_meta,
)
from olmoflow.data.tokenize_shards import load_tokenizer, tokenize_shard
from olmoflow.errors import OlmoflowError
from olmoflow.tokenizer import BPETokenizer

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega café naïve 東京 🙂").split()


def corpus(n_shards: int = 4, per_shard: int = 25) -> list[list[dict]]:
    rng = np.random.default_rng(0)
    shards = []
    for s in range(n_shards):
        docs = []
        for i in range(per_shard):
            words = rng.choice(WORDS, size=int(rng.integers(1, 60)))
            docs.append({"id": f"s{s}-d{i}", "text": " ".join(words), "source": f"src{s % 2}"})
        shards.append(docs)
    return shards


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tok")
    texts = [d["text"] for shard in corpus() for d in shard]
    BPETokenizer().train_from_texts(texts, vocab_size=300, min_frequency=1).save(d)
    return str(d)


def write_shards(root: Path) -> list[Path]:
    paths = []
    for i, docs in enumerate(corpus()):
        p = root / "mixed" / docs[0]["source"] / f"{i:05d}.jsonl.gz"
        write_documents(p, docs)
        paths.append(p)
    return paths


def tokenize_all(root: Path, tok_dir: str, executor: str, workers: int) -> list[dict]:
    rel = lambda p: f"{p.parent.name}/{p.name.replace('.jsonl.gz', '.npy')}"  # noqa: E731
    tasks = [{"input": str(p), "source": p.parent.name, "heldout": [i % 3],
              "parts": {s: str(root / "tokens" / s / rel(p)) for s in SPLITS},
              "tokenizer": tok_dir, "dtype": "auto"} for i, p in enumerate(write_shards(root))]
    results = run_shards(tokenize_shard, tasks, executor=executor, workers=workers)
    tok = load_tokenizer(tok_dir)
    write_meta(root / "tokens", tok, np.dtype("<u2"),
               [{s: Path(t["parts"][s]) for s in SPLITS} for t in tasks],
               [r["splits"] for r in results], tokenizer_dir=tok_dir, implementation="bpe",
               heldout={"seed": 0, "fraction": 0.0, "max_documents": 0})
    return results


def digests(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and p.name != "manifest.json"}


def test_parallel_tokenization_is_byte_identical_and_round_trips(tmp_path, tokenizer_dir):
    tokenize_all(tmp_path / "a", tokenizer_dir, "serial", 1)
    results = tokenize_all(tmp_path / "b", tokenizer_dir, "local", 2)
    assert digests(tmp_path / "a" / "tokens") == digests(tmp_path / "b" / "tokens")
    checked = check_token_dir(tmp_path / "b" / "tokens", expected_documents=100)
    assert checked["documents"] == 100 and checked["tokens"] == sum(r["tokens"] for r in results)
    # Every document decodes back to its text, and ends with EOS.
    tok = load_tokenizer(tokenizer_dir)
    docs = [d for shard in corpus() for d in shard]
    seen = 0
    for npy in sorted((tmp_path / "b" / "tokens").rglob("*.npy")):
        arr = read_token_array(npy, "uint16")
        rows = read_index(npy.with_name(npy.name.replace(".npy", ".csv.gz")))
        for start, end, doc_id, source in rows:
            doc = next(d for d in docs if d["id"] == doc_id)
            assert arr[end - 1] == tok.eos_token_id and source == doc["source"]
            assert tok.decode(arr[start:end - 1].tolist()) == doc["text"]
            seen += 1
    assert seen == 100
    # One held-out document per shard, as the tasks asked, and the directory opens for training.
    td = open_token_dir(tmp_path / "b" / "tokens")
    assert td.meta["splits"]["heldout"]["documents"] == 4 and len(td.heldout) == 4
    assert td.tokenizer_dir == Path(tokenizer_dir).resolve() and td.implementation == "bpe"


def test_check_tokens_catches_a_truncated_array_and_a_missing_document(tmp_path, tokenizer_dir):
    tokenize_all(tmp_path, tokenizer_dir, "serial", 1)
    with pytest.raises(OlmoflowError, match="went in"):
        check_token_dir(tmp_path / "tokens", expected_documents=101)
    npy = sorted((tmp_path / "tokens").rglob("*.npy"))[1]
    npy.write_bytes(npy.read_bytes()[:-2])
    # Caught on opening: the array's size no longer matches meta.json's token count.
    with pytest.raises(OlmoflowError, match=r"\.npy: \d+ bytes, but meta.json records"):
        check_token_dir(tmp_path / "tokens")


def test_uint16_refuses_a_large_vocabulary():
    from olmoflow.data.tokenize_shards import resolve_dtype

    assert resolve_dtype("auto", 100_278).name == "uint32"
    assert resolve_dtype("auto", 50_000).name == "uint16"
    with pytest.raises(OlmoflowError, match="uint16"):
        resolve_dtype("uint16", 100_278)
    with pytest.raises(OlmoflowError, match="did you mean 'uint32'"):
        resolve_dtype("uint23", 100)


def test_config_errors_name_the_closest_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("output: x\nsources:\n  - {name: a, paths: [a.jsonl]}\ntokenise: {}\n")
    with pytest.raises(OlmoflowError, match="unknown config key 'tokenise'; did you mean "
                                            "'tokenize"):
        load_data_config(cfg)
    cfg.write_text("sources:\n  - {name: a, path: [a.jsonl]}\n")
    with pytest.raises(OlmoflowError,
                       match=r"'sources\[0\]\.path'; did you mean 'sources\[0\]\.paths'"):
        load_data_config(cfg)
    cfg.write_text("executor: rey\n")
    with pytest.raises(OlmoflowError, match="did you mean 'ray'"):
        load_data_config(cfg)
    cfg.write_text("tokenize: {dtype: auto, vocab_size: 512}\n")
    assert load_data_config(cfg, ["tokenize.vocab_size=600", "executor=serial"]).tokenize \
        .vocab_size == 600
    cfg.write_text("sources: [\n")
    with pytest.raises(OlmoflowError, match=r"c.yaml:\d+: invalid YAML"):
        load_data_config(cfg)


def small_run(tmp: Path) -> Path:
    """A config over two JSONL files of short English-like documents (some repeated)."""
    rng = np.random.default_rng(1)
    for name in ("a", "b"):
        lines = []
        for i in range(12):
            words = rng.choice(WORDS[:20], size=60)
            lines.append({"text": " ".join(words) + ".", "n": i})
        lines += lines[:3] if name == "b" else []
        (tmp / "in").mkdir(exist_ok=True)
        (tmp / "in" / f"{name}.jsonl").write_text("".join(
            __import__("json").dumps(x) + "\n" for x in lines))
    cfg = tmp / "data.yaml"
    cfg.write_text(f"""
output: {tmp / "run"}
executor: serial
steps: [ingest, tag, dedup, mix, tokenize]
sources: [{{name: web, paths: ["{tmp / "in"}/*.jsonl"]}}]
taggers: [pii]
dedup: {{exact: true}}
tokenize: {{vocab_size: 300, min_frequency: 1}}
""")
    return cfg


def test_run_skips_done_steps_and_redoes_only_what_changed(tmp_path, capsys):
    from olmoflow.cli import main

    cfg = small_run(tmp_path)
    run = tmp_path / "run"
    assert main(["data", "run", str(cfg), "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines[1:6]] == ["ingest", "tag", "dedup", "mix", "tokenize"]
    assert "removed 3 (1 rules)" in lines[4]  # the three copies in b.jsonl
    before = digests(run / "tokens")
    assert check_token_dir(run / "tokens", expected_documents=24)["documents"] == 24

    assert main(["data", "run", str(cfg), "--no-progress"]) == 0
    assert sum("skipped (done)" in ln for ln in capsys.readouterr().out.splitlines()) == 5

    # A lost attribute shard: the tag step reruns that shard only; what follows is unchanged.
    markers = sorted((run / ".done" / "tag").glob("*.done.json"))
    stamps = {m: m.stat().st_mtime_ns for m in markers}
    lost = sorted((run / "attributes" / "tags").rglob("*.jsonl.gz"))[1]
    lost.unlink()
    assert main(["data", "tag", str(run), "--no-progress"]) == 0  # the run dir's config.yaml
    out = capsys.readouterr().out
    assert "tag" in out and "skipped" not in out and lost.is_file()
    assert sum(m.stat().st_mtime_ns != stamps[m] for m in markers) == 1
    assert main(["data", "run", str(cfg), "--no-progress"]) == 0
    assert sum("skipped (done)" in ln for ln in capsys.readouterr().out.splitlines()) == 5

    # A new mixer rule: only mix and tokenize run again.
    assert main(["data", "run", str(cfg), "--no-progress",
                 "mixer.exclude=['pii__count > 100']"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [("skipped" in ln) for ln in out[1:6]] == [True, True, True, False, False]
    assert digests(run / "tokens") == before  # the rule drops nothing


def test_bad_config_is_a_one_line_error(tmp_path, capsys):
    from olmoflow.cli import main

    cfg = small_run(tmp_path)
    assert main(["data", "run", str(cfg), "executr=ray"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "olmoflow: error: unknown config key 'executr'; did you mean 'executor'?"


def test_train_quality_verb_reports_heldout_accuracy(tmp_path, capsys):
    from olmoflow.cli import main

    pytest.importorskip("fasttext", reason="needs fasttext-numpy2 (pip install 'olmoflow[data]')")
    shared = Path(__file__).resolve().parents[3] / "shared" / "data" / "web-crawl"
    if not shared.is_dir():
        pytest.skip("../shared/data absent: the DCLM labeled examples are needed")
    files = [str(shared / "dclm_agreement_data.jsonl"), str(shared / "dclm_majority_data.jsonl")]
    assert main(["data", "train-quality", *files, "epoch=5", "--out", str(tmp_path)]) == 0
    report = __import__("json").loads(capsys.readouterr().out)
    assert 0.0 <= report["heldout_accuracy"] <= 1.0 and report["hyperparameters"]["epoch"] == 5
    assert (tmp_path / "quality.bin").is_file()
    assert main(["data", "train-quality", *files, "epochs=5", "--out", str(tmp_path)]) == 2
    assert "did you mean 'epoch'" in capsys.readouterr().err


SHOUTING = shouting_plugin("shouting")


def test_a_user_tagger_from_a_plugin_file_runs_in_the_workers(tmp_path):
    from olmoflow.data.engine import Engine
    from olmoflow.data.engine.report import step_manifests

    plugin = tmp_path / "shout.py"
    plugin.write_text(SHOUTING)
    base = small_run(tmp_path)
    docs = [{"text": "quiet words here"}, {"text": "LOUD WORDS HERE"}, {"text": "Mixed Case"}]
    for name in ("a", "b"):  # two shards, so two worker processes tag
        (tmp_path / "in" / f"{name}.jsonl").write_text(
            "".join(__import__("json").dumps(d) + "\n" for d in docs))
    cfg = load_data_config(base, [
        "executor=local", "workers=2", f"plugins=['{plugin}']", "taggers=[shouting]",
        "steps=[ingest, tag, mix]", f"sources=[{{name: web, paths: ['{tmp_path / 'in'}']}}]",
        "mixer={exclude: ['shouting__upper_fraction > 0.5']}"])
    Engine(cfg).run()
    mix = step_manifests(cfg.output)["mix"]["counts"]
    assert mix["removed"] == {"exclude: shouting__upper_fraction > 0.5":
                              {"documents": 2, "bytes": 2 * len("LOUD WORDS HERE")}}
    bad = load_data_config(base, [f"plugins=['{tmp_path / 'nope.py'}']",
                                                 "steps=[ingest, tag]"])
    with pytest.raises(OlmoflowError, match="plugins: cannot import"):
        Engine(bad).run()


def test_tokenize_with_a_given_tokenizer_directory(tmp_path, tokenizer_dir):
    from olmoflow.data.engine import Engine

    cfg = load_data_config(small_run(tmp_path), ["steps=[ingest, mix, tokenize]",
                                                 f"tokenize.tokenizer={tokenizer_dir}"])
    Engine(cfg).run()
    meta = __import__("json").loads((tmp_path / "run" / "tokens" / "meta.json").read_text())
    assert meta["vocab_size"] == load_tokenizer(tokenizer_dir).vocab_size
    assert sum(meta["splits"][s]["documents"] for s in SPLITS) == 27
    assert not (tmp_path / "run" / "tokenizer").exists()
    assert open_token_dir(tmp_path / "run" / "tokens").tokenizer_dir == Path(tokenizer_dir)
    bad = load_data_config(small_run(tmp_path), ["steps=[tokenize]",
                                                 f"tokenize.tokenizer={tmp_path}"])
    with pytest.raises(OlmoflowError, match="no tokenizer.json"):
        Engine(bad).run()


def markers(run: Path) -> dict[str, float]:
    """Every shard done-marker under the run (``.done/<step>/`` and any ``work/<set>/done``),
    with the time its job finished."""
    import json

    return {p.relative_to(run).as_posix(): json.loads(p.read_text())["finished"]
            for p in sorted(run.rglob("*.done.json"))}


def test_force_reruns_every_shard_of_every_step(tmp_path):
    from olmoflow.data.engine import STEP_NAMES, Engine

    cfg = small_run(tmp_path)
    ev = tmp_path / "eval.jsonl"
    ev.write_text('{"q": "alpha beta gamma delta epsilon zeta eta theta iota kappa"}\n')
    text = cfg.read_text().replace("steps: [ingest, tag, dedup, mix, tokenize]", "")
    cfg.write_text(text + f"decontaminate: {{evals: [], files: {{e: {{path: '{ev}', "
                          "fields: [q]}}, ngram: 5, action: tag}\n")
    run = tmp_path / "run"
    first = Engine(load_data_config(cfg)).run()
    assert [o.step for o in first] == list(STEP_NAMES)
    before, tokens = markers(run), digests(run / "tokens")
    # Markers live where --force looks: the engine's step names, not the modules' set names.
    assert {k.split("/")[1] for k in before if k.startswith(".done/")} == set(STEP_NAMES) - {"mix"}
    assert not any(k.startswith(".done/decontam/") for k in before)
    again = Engine(load_data_config(cfg), force=True).run()
    assert not any(o.skipped for o in again)
    after = markers(run)
    assert set(after) == set(before)
    stale = [k for k in before if after[k] <= before[k]]
    assert not stale, f"--force left these shards done: {stale}"
    assert digests(run / "tokens") == tokens  # and redoing them gives the same bytes


# --- a rerun after a kill or a removed source -----------------------------------------------------


def test_a_rerun_removes_temporaries_left_by_a_killed_writer(tmp_path):
    # After kill -9 mid-step, hidden `.<shard>.<random>.tmp` files stayed in the run directory
    # for good (a rerun wrote fresh ones beside them).
    cfg = load_data_config(engine_config(tmp_path))
    stale = tmp_path / "run" / "documents" / "web" / ".00000_a.jsonl.gz.k2j4x9.tmp"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"\x1f\x8b half a shard")
    Engine(cfg).run()
    assert not stale.exists()
    assert not list((tmp_path / "run").rglob("*.tmp"))


def test_removing_a_source_gives_the_bytes_of_a_fresh_run(tmp_path):
    # Dropping a source from the config and rerunning left its shards in mixed/ and tokens/ (a
    # glob over tokens/ still trained on them), and kept the other shards' token arrays from
    # the BPE trained before (their done-markers named the tokenizer by path only), while
    # tokenizer/ and meta.json described the retrained one.
    src = tmp_path / "in"
    src.mkdir()
    words = {"a": "river stone water bank fish reed mud", "b": "star orbit comet moon dust sky"}
    for name, vocab in words.items():
        rows = [{"text": " ".join(vocab.split()[i:] + vocab.split()[:i]) * 3} for i in range(7)]
        jsonl(src / f"{name}.jsonl", rows)
    body = ("executor: serial\nsteps: [ingest, mix, tokenize]\ntokenize: {vocab_size: 300, "
            "min_frequency: 1}\nsources:\n  - {name: a, paths: [%s]}\n" % (src / "a.jsonl"))
    both = body + "  - {name: b, paths: [%s]}\n" % (src / "b.jsonl")
    (tmp_path / "both.yaml").write_text(both)
    (tmp_path / "one.yaml").write_text(body)
    run, fresh = str(tmp_path / "run"), str(tmp_path / "fresh")
    Engine(load_data_config(tmp_path / "both.yaml", [f"output={run}"])).run()
    assert (tmp_path / "run" / "tokens" / "train" / "b").is_dir()
    Engine(load_data_config(tmp_path / "one.yaml", [f"output={run}"])).run()
    Engine(load_data_config(tmp_path / "one.yaml", [f"output={fresh}"])).run()
    for d in ("documents", "mixed", "tokens", "tokenizer"):
        assert digests(tmp_path / "run" / d) == digests(tmp_path / "fresh" / d), d
