"""One module per tool-call format; PARSERS maps the setting's names (engine.tool_call_parser) to them."""

from gateway.tools.parsers.base import CallPiece, ToolParser
from gateway.tools.parsers.deepseek_v3 import DeepSeekV3
from gateway.tools.parsers.hermes import Hermes
from gateway.tools.parsers.llama3_json import Llama3Json
from gateway.tools.parsers.mistral import Mistral

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (Hermes, Llama3Json, Mistral, DeepSeekV3)}

__all__ = ["PARSERS", "CallPiece", "DeepSeekV3", "Hermes", "Llama3Json", "Mistral", "ToolParser"]
