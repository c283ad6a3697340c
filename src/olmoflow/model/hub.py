"""Hugging Face Hub ids for :meth:`Olmo.from_pretrained
<olmoflow.model.olmo.Olmo.from_pretrained>`: ``"allenai/OLMo-2-0425-1B"`` as in OLMo's docs.

Offline by default: an id is looked up in the local Hugging Face cache (``HF_HUB_CACHE``, or
``cache_dir``; laid out ``models--org--name/snapshots/<commit>/...`` with ``refs/<revision>``
naming the commit), so a run never reaches the network unless asked to
(``allow_network=True`` or ``OLMOFLOW_ALLOW_NETWORK=1``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from olmoflow.errors import OlmoflowError

ALLOW_NETWORK_ENV = "OLMOFLOW_ALLOW_NETWORK"
# "org/name" as the Hub spells repository ids (no leading dot, one slash).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` has the form of a Hub repository id (``org/name``)."""
    return bool(_HUB_ID.match(name)) and not name.endswith((".", "-")) and ".." not in name


def network_allowed(allow_network: bool | None = None) -> bool:
    """``allow_network`` when given, else whether ``OLMOFLOW_ALLOW_NETWORK`` is ``1``/``true``/
    ``yes``."""
    if allow_network is not None:
        return bool(allow_network)
    return os.environ.get(ALLOW_NETWORK_ENV, "").strip().lower() in ("1", "true", "yes")


def resolve_pretrained(name_or_path: str | Path, *, revision: str | None = None,
                       allow_network: bool | None = None,
                       cache_dir: str | Path | None = None) -> Path:
    """The local directory of a model: a path as given, or a Hub id's cached snapshot.

    Args:
        name_or_path: an existing directory (returned as is), or a Hub id ``org/name``. Anything
            else is returned as a path, for the loader to report.
        revision: a branch, tag or commit of the Hub id (default ``main``): the cache's
            ``refs/<revision>`` names the snapshot, a full commit hash names it directly.
        allow_network: download what the cache lacks (``huggingface_hub.snapshot_download``);
            None reads ``OLMOFLOW_ALLOW_NETWORK``. Off, only the local cache is read.
        cache_dir: the Hugging Face cache to use (default ``HF_HUB_CACHE``).
    Returns:
        The snapshot directory (``.../models--org--name/snapshots/<commit>``) or the path.
    Raises:
        OlmoflowError: a Hub id not in the local cache (network not allowed), or one the Hub
            does not have or cannot be reached for (network allowed).
    """
    path = Path(name_or_path)
    name = str(name_or_path)
    if path.is_dir() or not is_hub_id(name):
        return path
    from huggingface_hub import snapshot_download

    online = network_allowed(allow_network)
    try:
        return Path(snapshot_download(name, revision=revision, cache_dir=cache_dir,
                                      local_files_only=not online))
    except Exception as e:  # huggingface_hub raises many kinds: not cached, 404, offline, auth
        where = f" at revision '{revision}'" if revision else ""
        cache = cache_dir if cache_dir is not None else _default_cache()
        if not online:
            raise OlmoflowError(
                f"'{name}'{where} is not a directory and was not found in the local Hugging Face "
                f"cache ({cache}); allow downloading it with allow_network=True or "
                f"{ALLOW_NETWORK_ENV}=1, or give a local directory") from None
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise OlmoflowError(f"cannot download '{name}'{where} from the Hugging Face Hub: "
                            f"{first}") from None


def _default_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
