"""Weight diagnosis before fine-tuning: per-tensor health statistics, flagged tensors, re-init.

OLMo's documentation asks users to run ``diagnose_weights`` on a checkpoint before fine-tuning it:
a checkpoint saved after a loss spike, or damaged on disk, can hold NaN/Inf values, a few huge
weights, or whole rows or layers driven to zero, and fine-tuning from it wastes the run. For each
parameter tensor this module measures:

- ``nan`` / ``inf``: counts of non-finite values;
- ``outliers``: the share of finite values with ``|w - center| > k * scale``. Center and scale are
  the median and the normal-consistent median absolute deviation (``1.4826 * MAD``), robust
  estimates of the mean and standard deviation: planted or diverged values inflate the plain
  standard deviation until they hide behind it (a tenth of a tensor at 100 sigma raises the std
  to ~31 sigma), while the MAD stays at the bulk's spread. A tensor whose MAD is 0 (a norm weight
  of ones) falls back to the plain standard deviation;
- ``rms``, ``norm`` and ``rms / init_rms``: against the root mean square the model's own
  initialisation gives that tensor (:meth:`Olmo.reset_parameters`: a normal of std ``init_std``
  truncated at 3 std for linear and embedding weights, ones for norm weights);
- ``dead_rows``: rows (output units) whose largest magnitude is below ``dead_tol``;
- ``sibling``: tensors of the same role in other layers (``blocks.*.attention.w_q.weight``) are
  its siblings; a tensor whose spread differs from the median of theirs by more than
  ``sibling_factor`` times (either way) is far from its siblings. The spread of a matrix is its
  robust standard deviation (a few outliers, counted above, do not move it; a layer scaled up or
  zeroed does), of a vector (a norm weight) its RMS.

A tensor is flagged when it holds any NaN/Inf, when its anomalies (non-finite values, outliers,
and the values of dead rows) exceed ``threshold`` of its elements (5% by default), or when it is
far from its siblings. :func:`reinit_flagged` re-draws the flagged tensors with the model's own
init and leaves every other tensor bit-identical.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from olmoflow.errors import OlmoflowError

# sqrt(Var) of a standard normal truncated at +-3: the RMS of trunc_normal_(std=1, a=-3, b=3)
# (1 - 2 a phi(a) / (2 Phi(a) - 1) with a = 3)
_TRUNC3_RMS = math.sqrt(1 - 6 * math.exp(-4.5) / math.sqrt(2 * math.pi)
                        / math.erf(3 / math.sqrt(2)))
_MAX_SCALE_SAMPLE = 1 << 22  # elements used to estimate median / MAD of very large tensors
_LAYER = re.compile(r"^blocks\.(\d+)\.")


@dataclass(frozen=True)
class DiagnoseSettings:
    """Thresholds of :func:`diagnose_model`.

    Attributes:
        k: a value is an outlier beyond ``k`` robust standard deviations from the median.
        threshold: a tensor is flagged when more than this share of its elements are anomalies.
        dead_tol: a row whose largest absolute value is below this is dead.
        sibling_factor: a tensor whose spread is more than this many times above or below the
            median spread of its siblings (same role, other layers; at least 3 of them) is
            flagged.
    Raises:
        OlmoflowError: a value out of range.
    """

    k: float = 6.0
    threshold: float = 0.05
    dead_tol: float = 1e-8
    sibling_factor: float = 3.0

    def __post_init__(self) -> None:
        if not self.k > 0:
            raise OlmoflowError(f"k must be > 0, got {self.k}")
        if not 0 <= self.threshold < 1:
            raise OlmoflowError(f"threshold must be in [0, 1), got {self.threshold}")
        if not self.dead_tol >= 0:
            raise OlmoflowError(f"dead_tol must be >= 0, got {self.dead_tol}")
        if not self.sibling_factor > 1:
            raise OlmoflowError(f"sibling_factor must be > 1, got {self.sibling_factor}")


@dataclass
class TensorReport:
    """The statistics of one parameter tensor (see the module docstring for each)."""

    name: str
    shape: list[int]
    numel: int
    nan: int
    inf: int
    outliers: int
    dead_rows: int
    rms: float
    norm: float
    init_rms: float | None
    scale: float = 0.0  # the robust standard deviation (1.4826 MAD; the std when the MAD is 0)
    sibling_ratio: float | None = None  # spread / median spread of the siblings
    reasons: list[str] = field(default_factory=list)

    @property
    def anomaly_share(self) -> float:
        """Share of elements that are non-finite, outliers, or in dead rows."""
        row = self.numel // self.shape[0] if len(self.shape) == 2 and self.shape[0] else 0
        return min(1.0, (self.nan + self.inf + self.outliers + self.dead_rows * row)
                   / max(self.numel, 1))

    @property
    def flagged(self) -> bool:
        return bool(self.reasons)


def init_rms(module: nn.Module, init_std: float | None) -> float | None:
    """The RMS :meth:`Olmo.reset_parameters` gives ``module``'s weight: ``init_std`` times the
    RMS of a unit normal truncated at 3 std for linear and embedding layers (None without an
    ``init_std``), 1 for norms; None for other modules."""
    from olmoflow.model.layers import RMSNorm

    if isinstance(module, nn.Linear | nn.Embedding):
        return None if init_std is None else init_std * _TRUNC3_RMS
    if isinstance(module, RMSNorm):
        return 1.0
    return None


def _robust_center_scale(finite: torch.Tensor) -> tuple[float, float]:
    """Median and ``1.4826 * MAD`` of a 1-D float tensor (a strided sample of very large ones);
    the plain standard deviation when the MAD is 0."""
    sample = finite
    if sample.numel() > _MAX_SCALE_SAMPLE:
        sample = sample[:: sample.numel() // _MAX_SCALE_SAMPLE + 1]
    center = sample.median()
    scale = 1.4826 * (sample - center).abs().median()
    if scale == 0:
        scale = finite.std(unbiased=False) if finite.numel() > 1 else finite.new_zeros(())
    return float(center), float(scale)


def tensor_report(name: str, w: torch.Tensor, settings: DiagnoseSettings,
                  expected_rms: float | None = None) -> TensorReport:
    """Statistics of one tensor ``w`` (any shape; rows are ``w[i]`` of a 2-D weight)."""
    w = w.detach().float()
    flat = w.reshape(-1)
    nan = int(torch.isnan(flat).sum())
    inf = int(torch.isinf(flat).sum())
    finite = flat[torch.isfinite(flat)] if nan or inf else flat
    outliers, scale = 0, 0.0
    if finite.numel() > 1:
        center, scale = _robust_center_scale(finite)
        if scale > 0:
            outliers = int(((finite - center).abs() > settings.k * scale).sum())
    dead = 0
    if w.dim() == 2:
        dead = int((w.nan_to_num(nan=1.0, posinf=1.0, neginf=1.0).abs().amax(-1)
                    < settings.dead_tol).sum())
    sq = float(finite.double().square().sum()) if finite.numel() else 0.0
    return TensorReport(
        name=name, shape=list(w.shape), numel=flat.numel(), nan=nan, inf=inf, outliers=outliers,
        dead_rows=dead, rms=math.sqrt(sq / max(finite.numel(), 1)), norm=math.sqrt(sq),
        init_rms=expected_rms, scale=scale,
    )


def _role(name: str) -> str | None:
    """``blocks.3.attn.w_q.weight`` -> ``blocks.*.attn.w_q.weight``; None outside the blocks."""
    return _LAYER.sub("blocks.*.", name) if _LAYER.match(name) else None


def _compare_siblings(reports: list[TensorReport], factor: float) -> None:
    groups: dict[str, list[TensorReport]] = {}
    for r in reports:
        role = _role(r.name)
        if role is not None:
            groups.setdefault(role, []).append(r)
    def spread(r: TensorReport) -> float:
        return r.scale if len(r.shape) == 2 else r.rms

    for members in groups.values():
        if len(members) < 3:
            continue
        for r in members:
            median = statistics.median(spread(m) for m in members if m is not r)
            if median <= 0:
                continue
            r.sibling_ratio = spread(r) / median
            if not 1 / factor <= r.sibling_ratio <= factor:
                r.reasons.append(f"spread {r.sibling_ratio:.3g}x its siblings' median")


def diagnose_model(model: nn.Module, settings: DiagnoseSettings | None = None,
                   init_std: float | None = None) -> list[TensorReport]:
    """A :class:`TensorReport` for every parameter of ``model`` (in ``named_parameters`` order),
    with ``reasons`` filled for the flagged ones.

    ``init_std`` defaults to ``model.config.init_std`` when the model has one (an
    :class:`~olmoflow.model.olmo.Olmo`); without it ``init_rms`` is None for linear layers.
    """
    settings = settings or DiagnoseSettings()
    if init_std is None:
        init_std = getattr(getattr(model, "config", None), "init_std", None)
    reports = []
    for name, p in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        r = tensor_report(name, p, settings, init_rms(owner, init_std))
        if r.nan or r.inf:
            r.reasons.append(f"{r.nan} NaN, {r.inf} Inf")
        if r.anomaly_share > settings.threshold:
            r.reasons.append(f"{r.anomaly_share:.1%} anomalous values (outliers {r.outliers}, "
                             f"dead rows {r.dead_rows})")
        reports.append(r)
    _compare_siblings(reports, settings.sibling_factor)
    return reports


@torch.no_grad()
def reinit_flagged(model: nn.Module, names: list[str], *, init_std: float,
                   seed: int = 0) -> list[str]:
    """Re-draw the parameters ``names`` of ``model`` in place with the model's own init (linear
    and embedding weights: normal of std ``init_std`` truncated at 3 std; norm weights: ones);
    every other parameter is left untouched. The draws come from a generator seeded with
    ``seed`` (in ``names`` order), so a rerun writes the same weights.

    Returns the names re-initialised.

    Raises:
        OlmoflowError: a name that is not a parameter, or one whose module has no known init.
    """
    from olmoflow.model.layers import RMSNorm

    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(seed)
    done = []
    for name in names:
        if name not in params:
            raise OlmoflowError(f"no parameter named '{name}' in the model")
        owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        p = params[name]
        if isinstance(owner, nn.Linear | nn.Embedding):
            fresh = torch.empty(p.shape, dtype=torch.float32)
            nn.init.trunc_normal_(fresh, 0.0, init_std, -3 * init_std, 3 * init_std,
                                  generator=gen)
            p.copy_(fresh.to(p.dtype))
        elif isinstance(owner, RMSNorm):
            p.fill_(1.0)
        else:
            raise OlmoflowError(f"'{name}' belongs to a {type(owner).__name__}, which has no "
                                "init to re-draw it with")
        done.append(name)
    return done


def format_table(reports: list[TensorReport], *, all_tensors: bool = False) -> str:
    """A fixed-width table of the reports (only the flagged ones unless ``all_tensors``)."""
    rows = [r for r in reports if all_tensors or r.flagged]
    head = (f"{'tensor':<40} {'shape':>14} {'nan':>6} {'inf':>6} {'outl%':>7} {'dead':>5} "
            f"{'rms':>9} {'rms/init':>8} {'vs sib':>7}  reasons")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{r.rms / r.init_rms:.3g}" if r.init_rms else "-"
        sib = f"{r.sibling_ratio:.3g}" if r.sibling_ratio is not None else "-"
        lines.append(
            f"{r.name:<40} {'x'.join(map(str, r.shape)):>14} {r.nan:>6} {r.inf:>6} "
            f"{100 * r.outliers / max(r.numel, 1):>6.2f}% {r.dead_rows:>5} {r.rms:>9.3g} "
            f"{ratio:>8} {sib:>7}  {'; '.join(r.reasons)}")
    return "\n".join(lines)


def report_dict(reports: list[TensorReport], settings: DiagnoseSettings,
                source: str) -> dict[str, Any]:
    """The JSON form of a diagnosis: settings, the flagged names, and every tensor's numbers."""
    return {
        "source": source, "settings": asdict(settings),
        "flagged": [r.name for r in reports if r.flagged],
        "tensors": [{**asdict(r), "anomaly_share": r.anomaly_share} for r in reports],
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON atomically."""
    from olmoflow.artifacts import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=1) + "\n")
