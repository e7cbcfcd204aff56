"""The family registry: which model class runs an HF architecture name."""

from __future__ import annotations

from runtime.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from runtime.models.gemma3 import Gemma3ForCausalLM
from runtime.models.llama import LlamaForCausalLM
from runtime.models.mistral import MistralForCausalLM
from runtime.models.qwen2 import Qwen2ForCausalLM

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}
assert set(MODEL_CLASSES) == SUPPORTED_ARCHITECTURES


def model_class_for(config: ModelConfig) -> type:
    """The class that builds `config`'s model; a clear error for an architecture we lack."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ValueError(
            f"unsupported architecture {config.architecture}; supported: {sorted(MODEL_CLASSES)}"
        )
    return cls
