"""``olmoflow plot RUN``: the training log drawn as PNG files.

Reads a training log, ``metrics.jsonl`` (see :mod:`olmoflow.train.metrics` for the keys), and
draws, for what the log holds:

- ``loss.png``: loss and cross-entropy, and z-loss below;
- ``lr.png``: the learning rate;
- ``grad_norm.png``: the global gradient norm (before clipping) and, on detailed steps, each layer's
  (up to 8 layers; deeper models: see the heatmap);
- ``throughput.png``: tokens/s, model FLOPs utilisation and the time spent waiting for data;
- ``system.png``: resident and CUDA memory, CPU/GPU use;
- ``heatmap_grad_norm.png``, ``heatmap_update_ratio.png``, ``heatmap_act_rms.png``,
  ``heatmap_param_norm.png``: layer x step heatmaps (log colour scale for the first two);
- ``attention_heads.png``: per head (rows: layer.head) x step, the normalised attention entropy
  (1 = uniform over the visible keys) and the mean max attention probability.

:func:`figures` returns the matplotlib figures without writing them, so what a picture shows can be
compared with the log; :func:`plot_run` writes them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from olmoflow.artifacts import atomic_open
from olmoflow.errors import OlmoflowError
from olmoflow.run_dir import TRAINING_LOG, RunDir
from olmoflow.train.loggers import read_log

HEATMAPS = {  # key prefix -> (title, log colour scale)
    "grad_norm": ("gradient norm per layer (before clipping)", True),
    "update_ratio": ("update-to-weight ratio ||dw|| / ||w|| per layer", True),
    "act_rms": ("activation RMS of the residual stream after each layer", False),
    "param_norm": ("parameter norm per layer", False),
}


def find_log(path: str | Path) -> Path:
    """The training log of ``path``: the file itself, ``path/metrics.jsonl`` (a training stage's
    directory) or the training log of the run directory ``path`` (:meth:`RunDir.training_log`).

    Raises:
        OlmoflowError: none of these exists.
    """
    p = Path(path)
    for cand in (p, p / TRAINING_LOG, RunDir(p).training_log()):
        if cand.is_file():
            return cand
    where = RunDir(p).training_log().relative_to(p)
    raise OlmoflowError(f"no training log at '{path}': expected a run directory (with "
                        f"{where.as_posix()}), a training stage's directory or a {TRAINING_LOG} "
                        "file")


def _run_name(log: Path) -> str:
    """The name of the run whose default training stage wrote ``log`` ("" when it is none)."""
    run = log.parent.parent
    return run.name if RunDir(run).training_log() == log else ""


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of the records that hold a number at ``key``."""
    pts = [(r["step"], float(r[key])) for r in records
           if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)]
    return [s for s, _ in pts], [v for _, v in pts]


def matrix(records: list[dict[str, Any]], prefix: str,
           pattern: str) -> tuple[list[int], list[str], list[list[float]]]:
    """A rows x steps table of the keys ``prefix/<row>`` whose ``<row>`` matches ``pattern``.

    Rows are sorted by the numbers in their names (``layer.2`` before ``layer.10``); columns are
    the records holding any such key. Missing cells are NaN. Returns ``(steps, rows, values)``.
    """
    rx = re.compile(rf"{re.escape(prefix)}/({pattern})$")
    rows: set[str] = set()
    cols = []
    for r in records:
        hits = {m.group(1): v for k, v in r.items() if (m := rx.match(k))}
        if hits:
            rows |= hits.keys()
            cols.append((r["step"], hits))

    def order(name: str) -> list[int]:
        return [int(n) for n in re.findall(r"\d+", name)]

    names = sorted(rows, key=order)
    values = [[float(h.get(n, float("nan"))) for _, h in cols] for n in names]
    return [s for s, _ in cols], names, values


def _step_axis(ax, steps: list[int]) -> None:
    """Label an image's column index with the step it shows."""
    ax.xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(
        lambda x, _: str(steps[int(round(x))]) if 0 <= round(x) < len(steps) else ""))
    ax.set_xlabel("step")


def _heatmap(fig: Figure, ax, steps, rows, values, title: str, log: bool, **kw) -> None:
    positive = [v for row in values for v in row if v > 0]
    norm = LogNorm(min(positive), max(positive)) if log and positive else None
    im = ax.imshow(values, aspect="auto", origin="lower", interpolation="nearest", norm=norm,
                   cmap="viridis", **kw)
    ax.set_yticks(range(len(rows)), rows, fontsize=7 if len(rows) > 16 else 9)
    _step_axis(ax, steps)
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax)


def _lines(ax, records, keys: list[str], ylabel: str, log: bool = False) -> bool:
    drew = False
    for key in keys:
        x, y = series(records, key)
        if x:
            ax.plot(x, y, label=key, marker="." if len(x) < 50 else None)
            drew = True
    if drew:
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if log and all(v > 0 for k in keys for v in series(records, k)[1]):
            ax.set_yscale("log")
        if len(ax.lines) > 1:
            ax.legend(fontsize=8)
    return drew


def figures(records: list[dict[str, Any]], title: str = "") -> dict[str, Figure]:
    """The figures for a log's ``records`` (see the module docstring), keyed by file name.

    Each line plot's data is the log's ``(step, value)`` pairs; each heatmap's image array is the
    :func:`matrix` of its key prefix. Figures whose keys the log lacks are left out.
    """
    out: dict[str, Figure] = {}

    def new(name: str, nrows: int = 1, height: float = 3.2) -> tuple[Figure, Any]:
        fig = Figure(figsize=(8, height * nrows), layout="constrained")
        axes = fig.subplots(nrows, 1, sharex=True, squeeze=False)[:, 0]
        fig.suptitle(f"{title}  {name}".strip() if title else name, fontsize=11)
        out[f"{name}.png"] = fig
        return fig, axes

    fig, axes = new("loss", 2)
    if not _lines(axes[0], records, ["loss", "ce_loss"], "loss (nats/token)"):
        del out["loss.png"]
    _lines(axes[1], records, ["z_loss"], "z-loss")
    axes[-1].set_xlabel("step")

    fig, axes = new("lr")
    if not _lines(axes[0], records, ["lr"], "learning rate"):
        del out["lr.png"]
    axes[-1].set_xlabel("step")

    fig, axes = new("grad_norm")
    layers = sorted({k for r in records for k in r if re.fullmatch(r"grad_norm/layer\.\d+", k)},
                    key=lambda k: int(k.rsplit(".", 1)[1]))
    if len(layers) > 8:  # a line per layer stops being readable; heatmap_grad_norm.png shows them
        layers = []
    if not _lines(axes[0], records, ["grad_norm"] + layers, "gradient norm (before clipping)",
                  log=True):
        del out["grad_norm.png"]
    axes[-1].set_xlabel("step")

    fig, axes = new("throughput", 3)
    drew = _lines(axes[0], records, ["tokens_per_s", "perf/tokens_per_s"], "tokens/s")
    drew |= _lines(axes[1], records, ["perf/mfu"], "MFU (fraction of matmul peak)")
    drew |= _lines(axes[2], records, ["data_wait_s"], "data wait (s)")
    axes[-1].set_xlabel("step")
    if not drew:
        del out["throughput.png"]

    fig, axes = new("system", 2)
    drew = _lines(axes[0], records, ["sys/rss_gb", "sys/peak_rss_gb", "sys/cuda_allocated_gb",
                                     "sys/cuda_peak_gb"], "memory (GB)")
    drew |= _lines(axes[1], records, ["sys/cpu_percent", "sys/cpu_system_percent",
                                      "sys/gpu_util_percent"], "use (%)")
    axes[-1].set_xlabel("step")
    if not drew:
        del out["system.png"]

    for prefix, (label, log) in HEATMAPS.items():
        steps, rows, values = matrix(records, prefix, r"layer\.\d+")
        if steps:
            fig, axes = new(f"heatmap_{prefix}", height=3.6)
            _heatmap(fig, axes[0], steps, rows, values, label, log)

    steps, rows, values = matrix(records, "attn_entropy_norm", r"layer\.\d+\.head\.\d+")
    if steps:
        fig, axes = new("attention_heads", 2, height=max(3.2, 0.18 * len(rows) + 1.2))
        _heatmap(fig, axes[0], steps, rows, values,
                 "attention entropy / ln(visible keys) (1 = uniform, 0 = one key)", False,
                 vmin=0.0, vmax=1.0)
        s2, r2, v2 = matrix(records, "attn_max_prob", r"layer\.\d+\.head\.\d+")
        if s2:
            _heatmap(fig, axes[1], s2, r2, v2, "mean max attention probability", False,
                     vmin=0.0, vmax=1.0)
    return out


def plot_run(path: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write the PNGs of the training log at ``path`` (see :func:`find_log`) into ``out``
    (default: ``plots/`` beside the log). Returns the files written.

    Raises:
        OlmoflowError: no log at ``path``, a malformed line, or a log with no numbers to plot.
    """
    log = find_log(path)
    records = [r for r in read_log(log) if isinstance(r.get("step"), int)]
    figs = figures(records, title=_run_name(log))
    if not figs:
        raise OlmoflowError(f"{log}: no training metrics to plot ({len(records)} records)")
    out_dir = Path(out) if out is not None else log.parent / "plots"
    written = []
    for name, fig in figs.items():
        with atomic_open(out_dir / name, "wb") as f:
            fig.savefig(f, format="png", dpi=110)
        written.append(out_dir / name)
    return written
