"""Model architectures the engine runs, by Hugging Face `model_type`.

MODEL_CLASSES maps a model_type to the engine class that runs it (one file each, beside this
one); a family not in it is not run by this engine.
"""
from hflow.engine.models.gemma3 import Gemma3CausalLM
from hflow.engine.models.llama import CausalLM
from hflow.engine.models.qwen3_moe import Qwen3MoeCausalLM

MODEL_CLASSES: dict[str, type] = {
    "llama": CausalLM,
    "mistral": CausalLM,
    "qwen2": CausalLM,
    "qwen3": CausalLM,
    "qwen3_moe": Qwen3MoeCausalLM,
    "gemma3_text": Gemma3CausalLM,
}
SUPPORTED_MODEL_TYPES = tuple(MODEL_CLASSES)


def build_model(hf_config, max_len: int, tp=None, dtype=None, device="cpu"):
    """Allocate (uninitialised) the engine's model for a transformers config."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MODEL_CLASSES:
        raise ValueError(f"hflow.engine does not support model_type {model_type!r}; "
                         f"supported model types: {', '.join(MODEL_CLASSES)}")
    return MODEL_CLASSES[model_type](hf_config, max_len, tp, dtype, device)
