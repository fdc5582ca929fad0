"""Build the engine a config asks for: a single-device `LLMEngine`, or with
`tensor_parallel_size` > 1 a `TPEngine` whose other ranks this starts (rank 0 is this
process). Above both, so that neither imports the other's module back.

    engine = start_engine(model_dir, EngineConfig(...))
"""

from __future__ import annotations

from pathlib import Path

from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine
from slora_core.tp.engine import TPEngine
from slora_core.tp.launch import start_tp_engine

AnyEngine = LLMEngine | TPEngine


def start_engine(model_dir: str | Path, config: EngineConfig, *,
                 detokenize: bool = True) -> AnyEngine:
    """The engine of `config` over a Hugging Face model directory; close() it when done."""
    if config.tensor_parallel_size > 1:
        return start_tp_engine(model_dir, config, detokenize=detokenize)
    return LLMEngine.from_model_dir(model_dir, config, detokenize=detokenize)
