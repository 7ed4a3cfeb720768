"""Model architectures the engine runs, by Hugging Face `model_type`.

MODEL_CLASSES maps a model_type to the engine class that runs it fast (one file each, beside
this one). Any other decoder runs on transformers' own model with the engine's paged attention
(transformers_fallback.py): slower, and one line on stderr says so.
"""
from hflow.engine.models.gemma3 import Gemma3CausalLM
from hflow.engine.models.llama import CausalLM
from hflow.engine.models.qwen3_moe import Qwen3MoeCausalLM
from hflow.engine.models.transformers_fallback import TransformersCausalLM, say_fallback, why_not_runnable

MODEL_CLASSES: dict[str, type] = {
    "llama": CausalLM,
    "mistral": CausalLM,
    "qwen2": CausalLM,
    "qwen3": CausalLM,
    "qwen3_moe": Qwen3MoeCausalLM,
    "gemma3_text": Gemma3CausalLM,
}
SUPPORTED_MODEL_TYPES = tuple(MODEL_CLASSES)


def runs_fast(model_type: str | None) -> bool:
    """Whether the engine has a class of its own for this family (else: transformers' model)."""
    return model_type in MODEL_CLASSES


def build_model(hf_config, max_len: int, tp=None, dtype=None, device="cpu"):
    """Allocate (uninitialised) the engine's model for a transformers config."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in MODEL_CLASSES:
        return MODEL_CLASSES[model_type](hf_config, max_len, tp, dtype, device)
    refusal = why_not_runnable(model_type)
    if refusal is not None:
        raise ValueError(f"hflow.engine cannot run model_type {model_type!r}: {refusal}")
    say_fallback(model_type, MODEL_CLASSES)
    return TransformersCausalLM(hf_config, max_len, tp, dtype, device)
