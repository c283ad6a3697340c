"""The ``olmoflow`` command: one verb per stage, plus ``run`` for the whole flow.

    olmoflow run [CONFIG] [key=value ...]          every stage, skipping those already complete
    olmoflow collect [CONFIG] [--data PATH ...]    one stage (likewise clean, train-tokenizer, ...)
    olmoflow generate [CONFIG] --prompt "..."      sample from the trained model
    olmoflow evaluate RUN --checkpoints all --tasks arc_easy,hellaswag
                                                   held-out BPB + tasks x checkpoints (heatmap)

Tool verbs take no run config:

    olmoflow model info PRESET                     shape, parameter counts and memory of a preset
    olmoflow model list                            the model presets
    olmoflow export hf CHECKPOINT OUT              a step directory -> a Hugging Face directory
    olmoflow export gguf CHECKPOINT OUT.gguf       ... -> one GGUF file for llama.cpp
    olmoflow plot RUN [--out DIR]                  the training log's curves and heatmaps as PNGs
    olmoflow plan CONFIG --gpus N [--tp K --pp K]  memory per GPU (DDP, FSDP, 3D layouts), a layout
    olmoflow data run CONFIG                       the data engine (see olmoflow.data.commands)
    olmoflow eval list | info TASK | run --model DIR --tasks SPECS
                                                   evaluation tasks (see olmoflow.eval.cli)
    olmoflow chat DIR [--system TEXT] [--seed N]   talk with a model in its chat template
    olmoflow merge-lora CHECKPOINT OUT             fold a LoRA run's adapters into an HF model
    olmoflow diagnose CHECKPOINT [--reinit OUT]    check weights for NaN/Inf, outliers, dead layers
    olmoflow data-order RUN --step N               the documents of step N's training batch
    olmoflow reproduce RUN --from CKPT --steps K   replay K steps and compare with the log exactly
    olmoflow verify DIR [--digest SHA]             re-hash a release back to its raw sources
    olmoflow push DIR ORG/NAME [--dry-run]         a release to the Hugging Face Hub, one branch
                                                   per checkpoint (needs the network)

CONFIG is a YAML file or a preset name under configs/, or a run directory (its saved
config.yaml, with run_dir the directory); without it, the --run-dir's saved config.yaml when that
directory holds a run, else the demo preset. Errors in the user's input print one line and exit
with status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from olmoflow.errors import OlmoflowError, Terminated
from olmoflow.pipeline.stages import STAGES

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="olmoflow",
                                description="The OLMo model flow, open end to end.")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("config", nargs="?", default=None,
                        help="YAML config file, preset name or run directory (default: the "
                        "--run-dir's saved config.yaml when it has one, else demo)")
        sp.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted config overrides, e.g. train.max_steps=200")
        sp.add_argument("--data", action="append", metavar="PATH",
                        help="collect from a file, directory or glob instead of the stdlib corpus")
        sp.add_argument("--follow-symlinks", action="store_true",
                        help="read files behind symbolic links that lead out of a --data "
                        "directory (skipped otherwise; collect.follow_symlinks)")
        sp.add_argument("--strict", action="store_true",
                        help="malformed input lines are errors (file and line named), not skipped")
        sp.add_argument("--run-dir", help="where the run's artifacts go (run_dir)")
        sp.add_argument("--force", action="store_true", help="redo stages even when complete")
        sp.add_argument("--no-progress", action="store_true", help="no progress bars")

    common(sub.add_parser("run", help="run every stage of the flow"))
    for stage in STAGES:
        sp = sub.add_parser(stage.name, help=stage.help or f"run the {stage.name} stage")
        common(sp)
        for flag in stage.flags:
            if flag.switch:  # None when not given: the config's value stands
                sp.add_argument(flag.option, dest=flag.dest, help=flag.help,
                                action="store_const", const=True, default=None)
            else:
                sp.add_argument(flag.option, dest=flag.dest, type=flag.type, help=flag.help,
                                action="append" if flag.repeat else "store")
    _tool_parsers(sub)
    return p


def _tool_parsers(sub) -> None:
    """Verbs that act on models and checkpoints rather than on a run: ``model``, ``export``."""
    model = sub.add_parser("model", help="model presets: list, info")
    msub = model.add_subparsers(dest="action", required=True, metavar="ACTION")
    info = msub.add_parser("info",
                           help="shape, parameters (counted on the meta device), bf16 memory")
    info.add_argument("preset", help="a model preset, e.g. olmo3_7b (see 'olmoflow model list')")
    info.set_defaults(tool=_model_info)
    lst = msub.add_parser("list", help="the model presets with their parameter counts")
    lst.set_defaults(tool=_model_list)

    export = sub.add_parser("export", help="export a checkpoint to another format: hf, "
                            "gguf")
    esub = export.add_subparsers(dest="action", required=True, metavar="FORMAT")
    hf = esub.add_parser("hf",
                         help="a Hugging Face directory (Olmo3ForCausalLM / Olmo2ForCausalLM)")
    hf.add_argument("checkpoint", help="a step directory (run_dir/pretrain/stepN), a checkpoint "
                    "folder with 'latest', or a Hugging Face directory")
    hf.add_argument("out", help="the directory to write (must not exist, or be empty)")
    hf.add_argument("--tokenizer",
                    help="directory with tokenizer.json (default: the tokenizer the run trained "
                    "with)")
    hf.add_argument("--dtype",
                    help="weights dtype: float32, bfloat16 or float16 (default: as stored)")
    hf.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    hf.set_defaults(tool=_export_hf)
    gg = esub.add_parser("gguf", help="one GGUF file for llama.cpp (architecture olmo2)")
    gg.add_argument("checkpoint", help="a step directory, a checkpoint folder with 'latest', or "
                    "a Hugging Face directory (a release)")
    gg.add_argument("out", help="the .gguf file to write (must not exist)")
    gg.add_argument("--dtype", default="f16",
                    help="2-D weights: f32, f16 or q8_0 (default: f16; norms stay f32)")
    gg.add_argument("--tokenizer",
                    help="directory with tokenizer.json (default: the tokenizer the run trained "
                    "with)")
    gg.add_argument("--force", action="store_true", help="replace an existing OUT")
    gg.set_defaults(tool=_export_gguf)

    plot = sub.add_parser("plot", help="draw a run's training log (loss, lr, grad norm, "
                          "throughput, per-layer and per-head heatmaps) into PNG files")
    plot.add_argument("run", help="a run directory, a training stage's directory or its "
                      "metrics.jsonl")
    plot.add_argument("--out", help="where the PNGs go (default: plots/ beside the log)")
    plot.set_defaults(tool=_plot)

    plan = sub.add_parser("plan", help="memory per GPU to train a run config under DDP and FSDP, "
                          "and the data x tensor x pipeline layout to use")
    plan.add_argument("config", help="YAML config file or preset name, e.g. olmo3_7b")
    plan.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    plan.add_argument("--gpus", type=int, default=8, help="GPUs in all (default: 8)")
    plan.add_argument("--gpu-memory-gb", type=float, default=80.0,
                      help="memory of one GPU in GB = 1e9 bytes (default: 80)")
    plan.add_argument("--tp", type=int, help="fix the tensor-parallel size (default: try all)")
    plan.add_argument("--pp", type=int, help="fix the pipeline-parallel size (default: try all)")
    plan.add_argument("--data-parallel", metavar="ddp|fsdp|hsdp",
                      help="fix the data-parallel method (default: try all)")
    plan.add_argument("--shard-size", type=int, help="HSDP ranks per shard group")
    plan.add_argument("--gpus-per-node", type=int, default=8,
                      help="GPUs per node, the largest tensor-parallel size tried (default: 8)")
    plan.add_argument("--all", action="store_true", help="list every layout, not the best 12")
    plan.set_defaults(tool=_plan)

    merge = sub.add_parser("merge-lora", help="fold a LoRA run's adapters into its base: a "
                           "Hugging Face directory of the merged model")
    merge.add_argument("checkpoint", help="a LoRA run's checkpoint directory (lora.json beside "
                       "it), or its folder with a 'latest' pointer")
    merge.add_argument("out", help="the Hugging Face directory to write")
    merge.add_argument("--tokenizer", help="directory with tokenizer.json (default: the run's)")
    merge.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    merge.set_defaults(tool=_merge_lora)

    from olmoflow.scripts.diagnose_weights import add_arguments as add_diagnose_arguments

    diagnose = add_diagnose_arguments(sub.add_parser(
        "diagnose", help="check a checkpoint's weights (NaN/Inf, outliers, dead rows, layers far "
        "from their siblings) before fine-tuning; exit 1 when a tensor is flagged"))
    diagnose.set_defaults(tool=_diagnose)

    order = sub.add_parser("data-order", help="the documents of one pretraining step's batch "
                           "(id, source, token span, start of the text)")
    order.add_argument("run", metavar="RUN", help="a run directory (with its config.yaml)")
    order.add_argument("--step", type=int, required=True, help="the training step (from 1)")
    order.add_argument("--chars", type=int, default=60,
                       help="characters of text shown per document (default 60; 0: none)")
    order.add_argument("--json", action="store_true", help="print JSON instead of a table")
    order.set_defaults(tool=_data_order)

    repro = sub.add_parser("reproduce", help="replay pretraining steps from a checkpoint and "
                           "compare every logged loss, grad norm and lr bit for bit; exit 1 at "
                           "the first difference")
    repro.add_argument("run", metavar="RUN", help="a run directory")
    repro.add_argument("--from", dest="checkpoint", required=True, metavar="CHECKPOINT",
                       help="a checkpoint directory, its name in RUN/pretrain, latest or stepN")
    repro.add_argument("--steps", type=int, default=20, help="steps to replay (default 20)")
    repro.add_argument("overrides", nargs="*", metavar="key=value",
                       help="change a setting of the replay (to see where it diverges)")
    repro.set_defaults(tool=_reproduce)

    verify = sub.add_parser("verify", help="re-hash every file of a release and follow its data "
                            "manifests to the raw sources; exit 1 on a changed, missing or added "
                            "file")
    verify.add_argument("release", metavar="DIR", help="a release directory (runs/NAME/release)")
    verify.add_argument("--digest", metavar="SHA",
                        help="the release digest published with the model (the sha256 of "
                        "files.json its card states): the release must be the one it names")
    verify.set_defaults(tool=_verify)

    push = sub.add_parser("push", help="upload a release to the Hugging Face Hub: main holds the "
                          "release, one branch per intermediate checkpoint (needs the network "
                          "and huggingface_hub)")
    push.add_argument("release", metavar="DIR", help="a release directory (runs/NAME/release)")
    push.add_argument("repo", metavar="ORG/NAME", help="the Hub model repository (created if it "
                      "does not exist; your token from HF_TOKEN or 'hf auth login')")
    push.add_argument("--private", action="store_true", help="create the repository private")
    push.add_argument("--dry-run", action="store_true",
                      help="print the branches and files it would upload, and upload nothing")
    push.set_defaults(tool=_push)

    from olmoflow.data.commands import add_data_parser
    from olmoflow.eval.cli import add_eval_parser
    from olmoflow.infer.chat import add_chat_parser
    from olmoflow.serve.cli import add_serve_parser

    add_data_parser(sub)
    add_eval_parser(sub)
    add_chat_parser(sub)
    add_serve_parser(sub)


TOOL_VERBS = ("model", "export", "data", "plot", "plan", "eval", "chat", "serve", "merge-lora",
              "diagnose", "data-order", "reproduce", "verify", "push")


def _diagnose(args: argparse.Namespace) -> int:
    from olmoflow.scripts.diagnose_weights import run

    return run(args)


def _data_order(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from olmoflow.pipeline.config import load_config
    from olmoflow.pipeline.data_order import format_spans, spans_json, step_documents
    from olmoflow.run_dir import RunDir, require_run_dir

    run = Path(args.run)
    require_run_dir(run)
    if args.chars < 0:
        raise OlmoflowError(f"--chars must be >= 0, got {args.chars}")
    cfg = load_config(str(RunDir(run).config), values={"run_dir": str(run)})
    spans = step_documents(cfg, args.step, chars=args.chars)
    if args.json:
        print(json.dumps({"step": args.step, "documents": spans_json(spans)}, indent=1))
    else:
        rows = len({s.row for s in spans})
        print(f"step {args.step}: {rows} instances, {len(spans)} document spans")
        print(format_spans(spans))


def _reproduce(args: argparse.Namespace) -> int:
    from olmoflow.pipeline.reproduce import describe, reproduce

    replay = reproduce(args.run, args.checkpoint, args.steps, args.overrides)
    print(describe(replay))
    return 0 if replay.exact else 1


def _verify(args: argparse.Namespace) -> int:
    from olmoflow.release.verify import describe, verify_release

    report = verify_release(args.release, digest=args.digest)
    print(describe(report))
    return 0 if report.ok else 1


def _push(args: argparse.Namespace) -> None:
    from olmoflow.release.push import describe_plan, push_plan, push_release

    if args.dry_run:
        from olmoflow.release.verify import verify_release

        report = verify_release(args.release)
        if not report.ok:
            raise OlmoflowError(f"'{args.release}' does not pass olmoflow verify "
                                f"({report.problems[0]}); it would not be pushed")
        print(describe_plan(args.repo, push_plan(args.release)))
        print("dry run: nothing uploaded")
        return
    plan = push_release(args.release, args.repo, private=args.private)
    print(describe_plan(args.repo, plan))
    print(f"pushed to https://huggingface.co/{args.repo}; a checkpoint loads with "
          f"from_pretrained('{args.repo}', revision='{plan[0].name}')")


def _plan(args: argparse.Namespace) -> None:
    from olmoflow.pipeline.config import load_config
    from olmoflow.train.plan_report import plan_config

    print(plan_config(load_config(args.config, args.overrides), args.gpus, args.gpu_memory_gb,
                      tp=args.tp, pp=args.pp, data_parallel=args.data_parallel,
                      shard_size=args.shard_size, gpus_per_node=args.gpus_per_node,
                      show_all=args.all))


def _plot(args: argparse.Namespace) -> None:
    from olmoflow.train.plot import plot_run

    files = plot_run(args.run, args.out)
    print(f"wrote {len(files)} plots to {files[0].parent}: {', '.join(f.name for f in files)}")


def _model_info(args: argparse.Namespace) -> None:
    from olmoflow.model.presets import format_info, get_preset

    print(format_info(args.preset, get_preset(args.preset)))


def _model_list(args: argparse.Namespace) -> None:
    from olmoflow.model.presets import PRESETS, meta_param_counts

    print(f"{'preset':<12} {'params':>16} {'non-embedding':>16}")
    for name, make in PRESETS.items():
        c = meta_param_counts(make())
        print(f"{name:<12} {c['total']:>16,} {c['non_embedding']:>16,}")


def _export_hf(args: argparse.Namespace) -> None:
    from olmoflow.release.export import export_hf

    out = export_hf(args.checkpoint, args.out, tokenizer=args.tokenizer, dtype=args.dtype,
                    force=args.force)
    print(f"exported '{args.checkpoint}' to '{out}' (load with "
          f"transformers.AutoModelForCausalLM.from_pretrained('{out}'))")


def _export_gguf(args: argparse.Namespace) -> None:
    from olmoflow.release.gguf_export import export_gguf

    out = export_gguf(args.checkpoint, args.out, dtype=args.dtype, tokenizer=args.tokenizer,
                      force=args.force)
    print(f"exported '{args.checkpoint}' to '{out}' ({args.dtype}; run with llama.cpp: "
          f"llama-cli -m '{out}')")


def _merge_lora(args: argparse.Namespace) -> None:
    from olmoflow.model.load import lora_settings_of, resolve_source
    from olmoflow.release.export import export_hf

    kind, src = resolve_source(args.checkpoint)
    if kind != "step" or lora_settings_of(src) is None:
        raise OlmoflowError(f"'{src}' is not a LoRA checkpoint (no lora.json beside it); "
                            "'olmoflow export hf' exports a checkpoint of every weight")
    out = export_hf(src, args.out, tokenizer=args.tokenizer, force=args.force)
    print(f"merged the adapters of '{src}' into '{out}'")


def _split_config_arg(args: argparse.Namespace) -> None:
    """``olmoflow run train.max_steps=5`` means the default preset with an override."""
    if args.config and "=" in args.config:
        args.overrides.insert(0, args.config)
        args.config = None


def _default_config(args: argparse.Namespace) -> None:
    """No CONFIG given: ``--run-dir DIR`` of an existing run stands for the config DIR was made
    with (its ``config.yaml``), as ``olmoflow VERB DIR`` does, so a verb run on it later neither
    runs it under another preset nor overwrites its config.yaml with one; otherwise ``demo``."""
    from olmoflow.run_dir import RunDir

    if args.config is not None:
        return
    if args.run_dir and RunDir(args.run_dir).config.is_file():
        args.config = str(RunDir(args.run_dir).config)
    else:
        args.config = "demo"


def _run_directory_config(args: argparse.Namespace, values: dict) -> None:
    """``olmoflow evaluate runs/demo``: a run directory stands for its saved ``config.yaml``,
    with ``run_dir`` that directory (wherever it was made), unless ``--run-dir`` says otherwise."""
    from pathlib import Path

    from olmoflow.config import resolve_preset
    from olmoflow.run_dir import RUN_MARKER, RunDir, require_run_dir

    p = Path(args.config)
    if not p.is_dir():
        return
    if not (p / RUN_MARKER).is_file() and any((p / f).is_file()
                                              for f in ("files.json", "config.json")):
        require_run_dir(p)  # a release or model directory: the message names its run
    if not RunDir(p).config.is_file():
        try:  # a folder that happens to share a preset's name leaves the preset meant
            resolve_preset(args.config)
            return
        except OlmoflowError:
            raise OlmoflowError(f"'{p}' is a directory but not a run directory (no config.yaml "
                                "in it); give a config file, a preset name or a run directory"
                                ) from None
    args.config = str(RunDir(p).config)
    values.setdefault("run_dir", str(p))


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input, 130 interrupted)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    parser = _parser()
    # parse_known_args: key=value overrides may also come after options ("--data X a.b=1").
    args, rest = parser.parse_known_args(argv)
    try:
        if args.verb in TOOL_VERBS:
            if rest and isinstance(getattr(args, "overrides", None), list) \
                    and all("=" in r and not r.startswith("-") for r in rest):
                args.overrides += rest  # `olmoflow data run CONFIG --force a.b=1`
            elif rest:
                parser.error(f"unrecognized arguments: {' '.join(rest)}")
            status = args.tool(args)
            if isinstance(status, int) and not isinstance(status, bool) and status:
                return status  # a tool's own verdict, e.g. diagnose: 1 = a tensor was flagged
        else:
            _run_pipeline_verb(parser, args, rest)
    except OlmoflowError as e:
        print(f"olmoflow: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        # Every rank of a torchrun job stops together: one line says so, not one per rank.
        term = isinstance(e, Terminated)
        if os.environ.get("RANK", "0") == "0":
            print(f"olmoflow: {'terminated (SIGTERM)' if term else 'interrupted'}",
                  file=sys.stderr)
        return 128 + e.signum if term else 130
    except BrokenPipeError:
        # `olmoflow data report DIR | head`: the reader left; say nothing more. Point stdout at
        # devnull so the interpreter's final flush does not raise a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:
        # a full disk (or quota, or file-size limit) anywhere a write path did not already say so
        from olmoflow.disk import write_failure

        err = write_failure(e.filename or "a file", e)
        if err is None:
            raise
        print(f"olmoflow: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _run_pipeline_verb(parser: argparse.ArgumentParser, args: argparse.Namespace,
                       rest: list[str]) -> None:
    """``run`` or one stage: load the run config (preset + overrides + flags) and run it."""
    stray = [r for r in rest if "=" not in r or r.startswith("-")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides += rest
    _split_config_arg(args)
    _default_config(args)
    from olmoflow.pipeline.config import load_config
    from olmoflow.pipeline.runner import run_pipeline

    values: dict = {}
    if args.data:
        values["collect.sources"] = args.data
    if args.strict:
        values["collect.strict"] = True
    if args.follow_symlinks:
        values["collect.follow_symlinks"] = True
    if args.run_dir:
        values["run_dir"] = args.run_dir
    _run_directory_config(args, values)
    force = args.force
    verb_stage = None if args.verb == "run" else STAGES[args.verb]
    for flag in verb_stage.flags if verb_stage else ():
        given = getattr(args, flag.dest, None)
        if given is not None and given != []:
            values[flag.key] = given
            force = force or flag.forces_rerun
    cfg = load_config(args.config, args.overrides, values, stage=args.verb)
    shown = STAGES.enabled(cfg) if verb_stage is None else [verb_stage]
    run_pipeline(cfg, stages=[s.name for s in shown] if verb_stage else None,
                 progress=not args.no_progress, force=force)
    from olmoflow.train.distributed import is_main

    if is_main():  # under torchrun only rank 0 prints
        for stage in shown:
            if stage.show is not None:
                stage.show(cfg)


if __name__ == "__main__":
    sys.exit(main())
