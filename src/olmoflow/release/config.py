"""Config section of the release bundle (``release``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReleaseConfig:
    """The release bundle's name and license (shown in the model card), and whether the
    intermediate checkpoints travel inside it.

    Attributes:
        include_checkpoints: export every kept checkpoint of every training stage in Hugging Face
            layout to ``checkpoints/<name>/``; false: reference each by its path in the run and
            the sha256 of its ``checksums.json`` (a much smaller bundle).
        plots: draw each training stage's log into ``plots/<stage>/`` (``olmoflow plot``).
        git: make the release a git repository once it is complete, weights in Git LFS and one
            tag per exported checkpoint (:mod:`olmoflow.release.git`; ``olmoflow release
            --git``). Bookkeeping: turning it on does not rebuild a complete release.
    """

    name: str = "olmoflow-model"
    license: str = "apache-2.0"
    include_checkpoints: bool = True
    plots: bool = True
    git: bool = False
