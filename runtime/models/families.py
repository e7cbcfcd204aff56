"""The family registry: which model class runs an HF architecture name."""

from __future__ import annotations

from runtime.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from runtime.models.llama import LlamaForCausalLM

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def model_class_for(config: ModelConfig) -> type:
    """The class that builds `config`'s model; a clear error for an architecture we lack."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ValueError(
            f"unsupported architecture {config.architecture}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES & set(MODEL_CLASSES))}"
        )
    return cls
