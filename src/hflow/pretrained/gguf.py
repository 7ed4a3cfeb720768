"""A .gguf file (llama.cpp's quantized format) to a dense Hugging Face directory.

hflow trains and generates from Hugging Face safetensors in the training dtype, so a quantized
checkpoint is dequantized once into fp32 (transformers reads GGUF with the optional `gguf`
package) and saved as an ordinary directory that every worker and the engine load as usual.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from hflow.validation import ConfigError


def require_gguf_package() -> None:
    """transformers reads .gguf files only with the `gguf` package, an optional extra of hflow."""
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError("reading a .gguf file needs the gguf package: pip install 'hflow[gguf]' "
                          "(or pip install gguf)")


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Dequantize `gguf_file` into `out_dir`: config, fp32 safetensors, generation config and the
    tokenizer (with its chat template) that the .gguf carries."""
    require_gguf_package()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file)
    where, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    # the dequantized model still says it is quantized (config.quantization_config), and
    # save_pretrained refuses a quantized model: build a plain one from the config and move the
    # weights over
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"{gguf_file}: its weights do not match {type(model).__name__}: missing "
                         f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}")
    model.generation_config = loaded.generation_config
    del loaded
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
