"""Inference engines behind one async streaming interface (see engines.base)."""

from engines.base import (
    Engine,
    EngineError,
    EngineOutput,
    EngineOverloadedError,
    EngineRequest,
    EngineRequestRejected,
    SamplingParams,
)

__all__ = ["Engine", "EngineError", "EngineOutput", "EngineOverloadedError", "EngineRequest", "EngineRequestRejected", "SamplingParams"]
