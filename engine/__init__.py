"""Tianmen's inference engine: paged KV cache, continuous batching, Llama/Qwen2/Mistral."""

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import (
    ConfigError,
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelLoadError,
    RequestFailedError,
)
from engine.llm import LLM, Completion
from engine.loader import DirectoryFiles, ModelFiles
from engine.outputs import Logprob, RequestOutput, Usage
from engine.params import SamplingParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "Completion",
    "ConfigError",
    "DirectoryFiles",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineOverloadedError",
    "InvalidRequestError",
    "Logprob",
    "ModelFiles",
    "ModelLoadError",
    "RequestFailedError",
    "RequestOutput",
    "SamplingParams",
    "Usage",
]
