"""A checkpoint's files checked under torchrun: rank 0 reads them, every rank raises its verdict.

The checksums themselves (what is recorded, how a file is compared) are
:mod:`olmoflow.model.checkpoint_files`, which every reader of a model uses alone.
"""

from __future__ import annotations

from pathlib import Path

from olmoflow.errors import OlmoflowError
from olmoflow.model.checkpoint_files import checkpoint_error
from olmoflow.train import distributed


def verify_checkpoint(path: Path, *, collective: bool = False) -> None:
    """Check every file of checkpoint directory ``path`` against the sha256 recorded at save time
    (:func:`olmoflow.model.checkpoint_files.verify_checkpoint`). ``collective``: under torchrun
    rank 0 checks and every rank raises its verdict.

    Raises:
        OlmoflowError: a file changed, is missing, was added or is a symbolic link; naming it.
    """
    path = Path(path)
    if collective:
        error = distributed.broadcast_object(checkpoint_error(path) if distributed.is_main()
                                             else None)
    else:
        error = checkpoint_error(path)
    if error is not None:
        raise OlmoflowError(error)
