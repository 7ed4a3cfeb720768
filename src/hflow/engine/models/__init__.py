"""Model architectures the engine runs, by Hugging Face `model_type`."""
from hflow.engine.models.llama import CausalLM

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def build_model(hf_config, max_len: int, tp=None, dtype=None, device="cpu") -> CausalLM:
    """Allocate (uninitialised) the engine's model for a transformers config."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"hflow.engine does not support model_type {model_type!r}; "
                         f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return CausalLM(hf_config, max_len, tp, dtype, device)
