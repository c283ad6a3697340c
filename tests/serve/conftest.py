"""Fixtures of the serving tests (helpers in ``serving.py``): the tiny trained model, a
release-like directory holding it, and a live server over it."""

from __future__ import annotations

import pytest
from serving import make_server, train_tiny


@pytest.fixture(scope="session")
def tiny_model():
    """``(model, tokenizer)`` from :func:`train_tiny` (shared: do not modify)."""
    return train_tiny()


@pytest.fixture(scope="session")
def release_dir(tiny_model, tmp_path_factory):
    """A release-like directory: HF model files and the tokenizer with its chat template."""
    model, tok = tiny_model
    d = tmp_path_factory.mktemp("serve-release")
    model.save_pretrained(d, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tok.save(d)
    return d


@pytest.fixture(scope="session")
def server(tiny_model):
    """A live server over the tiny model, no API key: ``server.url`` (no ``/v1``),
    ``server.engine``; model name :data:`MODEL_NAME`. Shared: leave its settings alone."""
    model, tok = tiny_model
    live = make_server(model, tok)
    yield live
    live.close()


@pytest.fixture(scope="session")
def base_url(server):
    """``http://127.0.0.1:PORT`` of :func:`server`."""
    return server.url
