from __future__ import annotations

from typing import Any

from torch import nn

from engine.errors import ModelLoadError
from engine.models.deepseek_v2 import DeepseekV2ForCausalLM
from engine.models.llama import LlamaForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,
}


def model_class(hf_config: dict[str, Any]) -> type[nn.Module]:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ModelLoadError(
        f"unsupported model architecture {archs or '(none in config.json)'}; supported: {', '.join(ARCHITECTURES)}"
    )
