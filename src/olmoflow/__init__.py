"""olmoflow: the OLMo model flow, open end to end.

Public API (mirrors the CLI)::

    from olmoflow import Olmo, Tokenizer
    model = Olmo.from_pretrained("runs/demo/release")
    tokenizer = Tokenizer.from_pretrained("runs/demo/release")
"""

from importlib import import_module

__version__ = "0.1.0"

# Imported on first use (PEP 562): `import olmoflow.data...` in a data-engine worker process must
# not pay torch's ~3 s import for names it never touches.
_LAZY = {
    "Olmo": "olmoflow.model.olmo",
    "ModelConfig": "olmoflow.model.config",
    "Tokenizer": "olmoflow.tokenizer",
    "BaseTokenizer": "olmoflow.tokenizer",
    "BPETokenizer": "olmoflow.tokenizer",
    "RunConfig": "olmoflow.pipeline.config",
    "load_config": "olmoflow.pipeline.config",
    "SamplingParams": "olmoflow.infer.sampling",
}
__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'olmoflow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
