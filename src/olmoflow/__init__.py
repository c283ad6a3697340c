"""olmoflow: the OLMo model flow, open end to end.

Public API (mirrors the CLI)::

    from olmoflow import Olmo, Tokenizer
    model = Olmo.from_pretrained("runs/demo/release")
    tokenizer = Tokenizer.from_pretrained("runs/demo/release")
"""

from olmoflow.config import RunConfig, load_config
from olmoflow.model.config import ModelConfig
from olmoflow.model.olmo import Olmo
from olmoflow.tokenizer import BaseTokenizer, BPETokenizer, Tokenizer

__version__ = "0.1.0"
__all__ = ["Olmo", "ModelConfig", "Tokenizer", "BaseTokenizer", "BPETokenizer", "RunConfig",
           "load_config", "__version__"]
