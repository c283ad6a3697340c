"""``files.json``, the index of a release bundle, and the release's digest.

``files.json`` is written after every other file of the bundle: ``{"files": {path: {"bytes",
"sha256"}}, "digest_stated_in": "README.md"}``, one entry per file (itself and the runner's
``manifest.json``, written after it, excepted). The sha256 of ``files.json`` is the release's
*digest*: it names the whole bundle, since every other file's hash is in it. The model card
states the digest, and ``olmoflow verify DIR --digest SHA`` checks a release against one published
elsewhere (a Hub revision's card, a paper).

The card cannot hold the hash of a file that holds the card's hash, so the entry of the file
named by ``digest_stated_in`` is the sha256 of that file with the digest written as 64 zeros
(:data:`PLACEHOLDER`, the same length: its ``bytes`` are the file's size). The card is written
with the placeholder, indexed, and then the placeholder is replaced by the digest.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from olmoflow.artifacts import atomic_write_json, atomic_write_text, sha256_file
from olmoflow.errors import OlmoflowError

FILE_INDEX = "files.json"
#: where the card states the digest (``files.json``'s ``digest_stated_in``).
CARD = "README.md"
#: the digest as the card is written before the index exists, and as its entry is hashed.
PLACEHOLDER = "0" * 64
#: the card's line stating the digest; :func:`stated_digest` finds it.
DIGEST_LABEL = "Release digest (the sha256 of `files.json`):"
_STATED = re.compile(re.escape(DIGEST_LABEL) + r" `([0-9a-f]{64})`")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def digest_line(digest: str = PLACEHOLDER) -> str:
    """The card's line stating ``digest`` (the placeholder until the index exists)."""
    return f"{DIGEST_LABEL} `{digest}`"


def stated_digest(text: str) -> str | None:
    """The digest the card's text states (its first :func:`digest_line`), or None."""
    m = _STATED.search(text)
    return m.group(1) if m else None


def parse_digest(given: str) -> str:
    """A digest as given on the command line: 64 hex digits, optionally after ``sha256:``;
    returned lower-cased.

    Raises:
        OlmoflowError: anything else (one line naming the option).
    """
    value = given.strip().lower().removeprefix("sha256:")
    if not _HEX64.match(value):
        raise OlmoflowError(f"--digest must be the 64 hex digits of a sha256 (the release "
                            f"digest its card states), got {given!r}")
    return value


def indexed_sha256(path: Path, stated_in: bool) -> str:
    """The sha256 ``files.json`` records for the file at ``path``: its bytes' hash, or for the
    file stating the digest (``stated_in``), the hash with that digest written as
    :data:`PLACEHOLDER` (see the module docstring)."""
    if not stated_in:
        return sha256_file(path)
    data = path.read_bytes()
    try:
        stated = stated_digest(data.decode("utf-8"))
    except UnicodeDecodeError:
        stated = None
    if stated is not None:
        data = data.replace(stated.encode(), PLACEHOLDER.encode())
    return hashlib.sha256(data).hexdigest()


def write_file_index(out: Path, files: list[Path]) -> str:
    """Write ``out/files.json`` for ``files`` (the files of the bundle, all under ``out``), then
    state its sha256 in ``out/README.md`` where the card holds :data:`PLACEHOLDER`; returns the
    digest. Anything else found in ``out`` later is an added file to ``olmoflow verify``."""
    root = Path(out).resolve()
    card = root / CARD
    stated = card.is_file() and digest_line() in card.read_text(encoding="utf-8")
    index = {}
    for p in sorted({Path(f).resolve() for f in files}):
        rel = p.relative_to(root).as_posix()
        if rel != FILE_INDEX:
            index[rel] = {"bytes": p.stat().st_size,
                          "sha256": indexed_sha256(p, stated and rel == CARD)}
    record: dict = {"files": index}
    if stated:
        record["digest_stated_in"] = CARD
    atomic_write_json(root / FILE_INDEX, record)
    digest = sha256_file(root / FILE_INDEX)
    if stated:
        atomic_write_text(card, card.read_text(encoding="utf-8").replace(PLACEHOLDER, digest))
    return digest
