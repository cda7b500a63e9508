"""Architecture name (config.json `architectures`) -> model class."""

from __future__ import annotations

from inferd.errors import ModelLoadError
from inferd.models.base import CausalLM
from inferd.models.gemma3 import Gemma3ForCausalLM
from inferd.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,  # text part only
}


def model_class_for(config) -> type[CausalLM]:
    names = getattr(config, "architectures", None) or []
    for name in names:
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    raise ModelLoadError(
        f"unsupported architecture {names or config.model_type!r}; inferd runs: {', '.join(MODEL_CLASSES)}"
    )
