"""Config section of the release bundle (``release``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReleaseConfig:
    """The release bundle's name and license, shown in the model card."""

    name: str = "olmoflow-model"
    license: str = "apache-2.0"
