"""lm-evaluation-harness both ways, offline: lm-eval tasks answered by the ``olmoflow`` model type
(all three request types), and cross-checked against lm-eval's own ``hf`` backend on the
Hugging Face export of the same tiny model (per-example log-likelihoods and accuracy)."""

import json
import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the reference here")
import lm_eval  # noqa: E402
import yaml  # noqa: E402

import olmoflow.eval.lm_eval_adapter as adapter  # noqa: E402
from olmoflow.errors import OlmoflowError  # noqa: E402
from olmoflow.model.config import ModelConfig  # noqa: E402
from olmoflow.model.olmo import Olmo  # noqa: E402

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
LM_EVAL_TASKS = Path(lm_eval.__file__).parent / "tasks"
ABS = 1e-4

QA = [("What is the capital of France?", ["Paris", "London", "Rome"], 0),
      ("What color is the sky on a clear day?", ["green", "blue", "red"], 1),
      ("How many legs does a cat have?", ["two", "six", "four"], 2),
      ("Which animal barks?", ["the dog", "the fish"], 0)]
PROSE = ["The cat sat on the mat. The dog sat on the log. " * 6,
         "A short line of text about the weather, which was sunny and warm.",
         "Questions and answers about cats, dogs, the sky and the capital of France."]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No network: the hub and datasets are told so, and any connection attempt fails."""
    import datasets
    import huggingface_hub.constants as hub

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))

    def refuse(*args, **kwargs):
        raise OSError("test is offline: no network connections")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def save_tiny(out: Path, texts: list[str], vocab: int = 400, seq: int = 512) -> Path:
    """A random tiny OLMo 3 (sliding window 16, GQA) and a BPE trained on ``texts``, saved as a
    Hugging Face directory (what ``olmoflow export hf`` writes)."""
    from olmoflow.tokenizer import BPETokenizer

    tok = BPETokenizer().train_from_texts(texts, vocab_size=vocab)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=((tok.vocab_size + 127) // 128) * 128, d_model=64, n_layers=2,
                      n_heads=4, n_kv_heads=2, mlp_hidden=128, max_sequence_length=seq,
                      sliding_window=16)
    model = Olmo(cfg).eval()
    with torch.no_grad():  # untrained norms are all 1; perturb so a misplaced norm would show
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tok.save(out)
    return out


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def local_tasks(tmp_path: Path) -> list[dict]:
    """Three lm-eval task configs over jsonl files written here: multiple choice, rolling
    log-likelihood (perplexity) and generation."""
    mc = write_jsonl(tmp_path / "mc.jsonl",
                     [{"q": q, "choices": c, "label": a} for q, c, a in QA])
    ppl = write_jsonl(tmp_path / "ppl.jsonl", [{"text": t} for t in PROSE])
    gen = write_jsonl(tmp_path / "gen.jsonl", [{"q": q, "a": c[a]} for q, c, a in QA])

    def data(f):
        return {"data_files": {"test": str(f)}, "cache_dir": str(tmp_path / "cache")}

    return [
        {"task": "tiny_mc", "dataset_path": "json", "dataset_kwargs": data(mc),
         "test_split": "test", "output_type": "multiple_choice",
         "doc_to_text": "Question: {{q}}\nAnswer:", "doc_to_choice": "{{choices}}",
         "doc_to_target": "label",
         "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]},
        {"task": "tiny_ppl", "dataset_path": "json", "dataset_kwargs": data(ppl),
         "test_split": "test", "output_type": "loglikelihood_rolling",
         "doc_to_text": "", "doc_to_target": "{{text}}",
         "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"},
                         {"metric": "bits_per_byte"}]},
        {"task": "tiny_gen", "dataset_path": "json", "dataset_kwargs": data(gen),
         "test_split": "test", "output_type": "generate_until",
         "doc_to_text": "Question: {{q}}\nAnswer:", "doc_to_target": " {{a}}",
         "generation_kwargs": {"until": ["\n", "Question:"], "max_gen_toks": 8,
                               "do_sample": False, "temperature": 0.0},
         "metric_list": [{"metric": "exact_match"}]},
    ]


def per_example(out: dict, task: str) -> list:
    """The (filtered) responses of each example of ``task``, in doc order."""
    return [s["filtered_resps"] for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])]


def run(model: str, model_args: str, tasks: list[dict], **kw) -> dict:
    """``simple_evaluate`` on task configs written as YAML files to a fresh folder, indexed alone
    (lm-eval's built-in index of thousands of YAMLs takes ~15 s to build)."""
    from lm_eval.tasks import TaskManager

    folder = Path(tasks[0]["dataset_kwargs"]["cache_dir"]).parent / f"tasks-{model}"
    folder.mkdir(exist_ok=True)
    for t in tasks:
        (folder / f"{t['task']}.yaml").write_text(yaml.safe_dump(t))
    tm = TaskManager(include_path=str(folder), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, model_args=model_args,
                                   tasks=[t["task"] for t in tasks], task_manager=tm,
                                   batch_size=4, device="cpu", log_samples=True,
                                   bootstrap_iters=0, **kw)


def assert_same(ours: dict, ref: dict, task: str) -> None:
    """Per-example log-likelihoods within ABS and the same metrics (accuracy exactly)."""
    a, b = per_example(ours, task), per_example(ref, task)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        if isinstance(x, str) or (x and isinstance(x[0], str)):
            assert x == y
        else:
            xs = [float(v[0] if isinstance(v, list | tuple) else v) for v in x]
            ys = [float(v[0] if isinstance(v, list | tuple) else v) for v in y]
            assert xs == pytest.approx(ys, abs=ABS, rel=0)
    for metric, value in ref["results"][task].items():
        if metric.startswith("acc") and "stderr" not in metric:
            assert ours["results"][task][metric] == value, metric
        elif isinstance(value, float) and "stderr" not in metric:
            assert ours["results"][task][metric] == pytest.approx(value, rel=1e-4), metric


def test_local_tasks_all_request_types(tmp_path):
    d = save_tiny(tmp_path / "model", [q for q, _, _ in QA] * 5 + PROSE * 5)
    tasks = local_tasks(tmp_path)
    ours = run("olmoflow", f"pretrained={d},max_length=128", tasks)
    for name in ("tiny_mc", "tiny_ppl", "tiny_gen"):
        assert name in ours["results"]
    assert 0.0 <= ours["results"]["tiny_mc"]["acc,none"] <= 1.0
    assert ours["results"]["tiny_ppl"]["word_perplexity,none"] > 1.0
    assert len(per_example(ours, "tiny_gen")) == len(QA)
    # the same through lm-eval's reference backend on the same files
    ref = run("hf", f"pretrained={d},max_length=128,dtype=float32", tasks)
    for name in ("tiny_mc", "tiny_ppl", "tiny_gen"):
        assert_same(ours, ref, name)


def test_model_args_errors(tmp_path):
    with pytest.raises(OlmoflowError, match="pretrained=DIR"):
        adapter.OlmoflowLMEval()
    with pytest.raises(OlmoflowError, match="no config.json"):
        adapter.OlmoflowLMEval(pretrained=str(tmp_path))
    with pytest.raises(OlmoflowError, match="unknown olmoflow model_args: colour"):
        adapter.OlmoflowLMEval(pretrained=str(tmp_path), colour="red")
    with pytest.raises(OlmoflowError, match="greedily"):
        adapter._generate_request("x", {"until": ["\n"], "do_sample": True, "temperature": 0.7})
    r = adapter._generate_request("x", {"until": "\n\n", "max_gen_toks": 5})
    assert r.until == ("\n\n",) and r.max_new_tokens == 5


def _arc_rows(n):
    rows = []
    with open(SHARED / "arc" / "ARC-Easy-Test.jsonl") as f:
        for line in f:
            d = json.loads(line)
            ch = d["question"]["choices"]
            rows.append({"id": d["id"], "question": d["question"]["stem"],
                         "choices": {"text": [c["text"] for c in ch],
                                     "label": [c["label"] for c in ch]},
                         "answerKey": d["answerKey"]})
            if len(rows) == n:
                break
    return rows


def _piqa_rows(n):
    docs = [json.loads(x) for x in (SHARED / "piqa" / "valid.jsonl").read_text().splitlines()[:n]]
    labels = (SHARED / "piqa" / "valid-labels.lst").read_text().split()[:n]
    return [{**d, "label": int(y)} for d, y in zip(docs, labels)]


def _lm_eval_task(name: str, yaml_rel: str, split: str, data: Path, tmp_path: Path) -> dict:
    """lm-eval's own task YAML with its dataset pointed at a local jsonl (HF schema)."""
    cfg = yaml.safe_load((LM_EVAL_TASKS / yaml_rel).read_text())
    cfg.pop("tag", None)
    cfg.update(task=f"local_{name}", dataset_path="json", dataset_name=None,
               dataset_kwargs={"data_files": {split: str(data)},
                               "cache_dir": str(tmp_path / "cache")},
               training_split=None, validation_split=None, test_split=None)
    cfg[f"{split}_split"] = split
    return cfg


@pytest.mark.skipif(not (SHARED / "arc" / "ARC-Easy-Test.jsonl").is_file()
                    or not (SHARED / "piqa" / "valid.jsonl").is_file(),
                    reason=f"ARC-Easy / PIQA copies not found under {SHARED}")
def test_cross_check_hf_backend_on_arc_easy_and_piqa(tmp_path):
    n = 30
    arc, piqa = _arc_rows(n), _piqa_rows(n)
    texts = ([r["question"] + " " + " ".join(r["choices"]["text"]) for r in arc]
             + [r["goal"] + " " + r["sol1"] + " " + r["sol2"] for r in piqa])
    d = save_tiny(tmp_path / "model", texts, vocab=800)
    tasks = [
        _lm_eval_task("arc_easy", "arc/arc_easy.yaml", "test",
                      write_jsonl(tmp_path / "arc.jsonl", arc), tmp_path),
        _lm_eval_task("piqa", "piqa/piqa.yaml", "validation",
                      write_jsonl(tmp_path / "piqa.jsonl", piqa), tmp_path),
    ]
    ours = run("olmoflow", f"pretrained={d},max_length=512", tasks, limit=n)
    ref = run("hf", f"pretrained={d},max_length=512,dtype=float32", tasks, limit=n)
    for name in ("local_arc_easy", "local_piqa"):
        assert len(per_example(ours, name)) == n
        assert_same(ours, ref, name)
    native_matches_lm_eval(d, ref, "local_arc_easy", n, tmp_path)


def native_matches_lm_eval(model_dir: Path, ref: dict, name: str, n: int, tmp_path: Path):
    """Our own harness's arc_easy, 0-shot rc (OLMES's "Question: ...\nAnswer:" + " choice",
    the same prompt as lm-eval's arc_easy), on the same first ``n`` documents: the same requests,
    the same log-likelihoods as lm-eval's hf backend, and acc_raw == lm-eval's acc."""
    from olmoflow.eval.harness import run_tasks
    from olmoflow.eval.registry import get_task, task_names
    from olmoflow.eval.scorer import OlmoflowLM
    from olmoflow.eval.task import EvalSettings
    from olmoflow.tokenizer.bpe import BPETokenizer

    try:
        import olmoflow.eval.tasks  # noqa: F401
    except ImportError as e:  # the built-in tasks are being written alongside this adapter
        pytest.skip(f"olmoflow.eval.tasks does not import: {e}")
    if "arc_easy" not in task_names():
        pytest.skip("no native arc_easy task registered")
    data = tmp_path / "native" / "arc"
    data.mkdir(parents=True)
    with open(SHARED / "arc" / "ARC-Easy-Test.jsonl") as f:
        (data / "ARC-Easy-Test.jsonl").write_text("".join(next(f) for _ in range(n)))
    task = get_task("arc_easy", EvalSettings(num_shots=0, formulation="rc", split="test",
                                             data_dir=tmp_path / "native"))
    lls = {tuple(a): float(r[0]) for s in ref["samples"][name]
           for a, r in zip(s["arguments"], s["filtered_resps"])}
    docs = task.load()
    assert len(docs) == n
    lm = OlmoflowLM(Olmo.from_pretrained(model_dir), BPETokenizer.load(model_dir), batch_size=4,
                    max_length=512)
    for doc in docs:
        reqs = task.requests(doc)[:len(doc.continuations)]  # the conditioned ones
        assert all((r.context, r.continuation) in lls for r in reqs), "prompts differ"
        got = [r.logprob for r in lm.loglikelihood(reqs)]
        assert got == pytest.approx([lls[r.context, r.continuation] for r in reqs], abs=ABS, rel=0)
    (res,) = run_tasks(lm, [task])
    assert res.metrics["acc_raw"] == ref["results"][name]["acc,none"]


BOUNDARY_TEXTS = ["The year was 1999 and the party was over. In 1990 we said:\n\nYes. "
                  "She said:\n\nNo.",
                  "He said:\n\nMaybe. The year was 1995, then 1999 came. Years: 19, 199, 1999."]


def save_trained(out: Path, texts: list[str], steps: int = 40) -> Path:
    """:func:`save_tiny`'s model after ``steps`` Adam steps of next-token loss on ``texts`` (so
    the context it sees matters the way it does for a real model), saved again in place."""
    from olmoflow.tokenizer import BPETokenizer

    save_tiny(out, texts * 20, seq=128)
    tok, model = BPETokenizer.load(out), Olmo.from_pretrained(out).train()
    ids = torch.tensor([sum((tok.encode(t, add_eos=True) for t in texts), [])[:128]])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().save_pretrained(out, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return out


def test_boundary_merge_scores_as_the_hf_backend(tmp_path):
    """A BPE merge across the context/continuation boundary ('19' + '99' -> '199' '9', ':' +
    '\\n\\nYes.' -> ':\\n\\n' 'Yes' '.'): the context is encoded alone, as lm-eval 0.4's
    ``_encode_pair`` does, so the tokens and the log-likelihoods equal its ``hf`` backend's."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    d = save_trained(tmp_path / "model", BOUNDARY_TEXTS)
    pairs = [("The year was 19", "99"), ("She said:\n\n", "Yes."), ("The year was", " 1999")]
    ours = adapter.OlmoflowLMEval(pretrained=str(d), max_length=128, device="cpu", batch_size=2)
    ref = HFLM(pretrained=str(d), max_length=128, dtype="float32", device="cpu", batch_size=1)
    tok = ours.scorer.tokenizer
    for context, continuation in pairs[:2]:  # the merge is there, so the old split differed
        c = context.rstrip()
        whole = tok.encode(c + context[len(c):] + continuation)
        assert whole[:len(tok.encode(c))] != tok.encode(c), (context, continuation)
    for context, continuation in pairs:
        assert ours.scorer.encode_pair(context, continuation) == \
            tuple(ref._encode_pair(context, continuation))

    def instances():
        return [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i)
                for i, p in enumerate(pairs)]

    got = ours.loglikelihood(instances(), disable_tqdm=True)
    want = ref.loglikelihood(instances(), disable_tqdm=True)
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=ABS, rel=0)
    assert [g[1] for g in got] == [w[1] for w in want]
