"""The embedded default: a small Qwen2-style model and tokenizer that hflow builds itself.

Nothing is downloaded. The tokenizer is a byte-level BPE (vocab 512) trained by the `tokenizers`
library on text of the default task (2-digit `+`/`-` problems, "12+35=" -> "47") plus a little
generic English; the model is a randomly initialised `Qwen2ForCausalLM` drawn from a seed.
Both are deterministic: the same seed gives byte-identical files.

    build_default("/tmp/m", size="default")          # config, safetensors, tokenizer, gen. config
    path = default_model_dir("default")               # same, built once into the cache (cache.py)
    AutoModelForCausalLM.from_pretrained(path); AutoTokenizer.from_pretrained(path)

Why Qwen2's pre-tokenizer: transformers 5.x reloads a tokenizer saved next to a `model_type`
qwen2 config as its own `Qwen2Tokenizer`, which rebuilds pre-tokenization from vocab + merges
with Qwen2's regex. A BPE trained with any other pre-tokenizer would reload as a *different*
tokenizer. Qwen2's regex splits every digit on its own, which suits arithmetic: each digit is
one token, so the model sees numbers place by place.

Token ids: 0 `<|endoftext|>` (pad), 1 `<|im_start|>`, 2 `<|im_end|>` (eos, ends an assistant
turn as in Qwen2.5-Instruct), then the 256 byte tokens, then merges.
"""
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from hflow.default.cache import build_once, cache_root

# Bump when anything below changes what gets built: cached directories carry it in their name.
FORMAT_VERSION = 1

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
EOS_TOKEN = IM_END

# Qwen2's pre-tokenizer regex, exactly as transformers' Qwen2Tokenizer uses it (see module doc).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Minimal Qwen-style chat template: `<|im_start|>role\ncontent<|im_end|>\n` per message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


SIZES = {
    "tiny": ModelSize(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=256),        # ~0.1M, tests
    "default": ModelSize(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=1024),   # ~3.5M
    "25m": ModelSize(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536),       # ~25M, benchmarks
}

VOCAB_SIZE = 512
MAX_POSITIONS = 256

_GENERIC_TEXT = """\
You are a helpful assistant. Answer the question with a single number.
What is the sum of two numbers? Add them together. What is the difference? Subtract the
second number from the first. If the second number is larger, the answer is negative.
Question: How many apples are left if you have 12 apples and you eat 5 of them? Answer: 7.
The answer is the number that makes the equation true. Let us think step by step.
Numbers can be added, subtracted, multiplied and divided. Addition is the first operation
that children learn at school, and subtraction is the second one. A number with two digits
has a tens digit and a units digit. To add two numbers, add the units first, then the tens,
and carry one when the units sum to ten or more. To subtract, borrow one ten when the units
digit of the first number is smaller than the units digit of the second.
The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore.
The weather today is sunny with a light wind from the west, and tomorrow it will rain.
This model is small and it was trained from scratch. It knows only a little about the world.
Please write your final answer after the equals sign, and then stop.
Reward: one if the answer is correct, zero otherwise. Reinforcement learning from rewards.
user assistant system question answer problem solution correct wrong total result
"""


def task_pairs(num_problems: int = 4000, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of the default task, ("12+35=", "47") or ("12-35=", "-23")."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(num_problems):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        op = rng.choice("+-")
        pairs.append((f"{a}{op}{b}=", str(a + b if op == "+" else a - b)))
    return pairs


def _training_corpus() -> list[str]:
    # Prompt and answer are separate strings: a learned "=-" merge would make "12-35=" + "-23"
    # tokenise differently from "12-35=-23". Special tokens stay out of the text (the trainer
    # would spend merges on "<|", "im", "|>"); the chat lines keep only what is between them.
    pairs = task_pairs()
    chat = ["system\nYou are a helpful assistant.", "user\nWhat is", "assistant\nThe answer is"]
    generic = _GENERIC_TEXT.splitlines()
    # Repeat the generic text so that its common words outweigh one-off pairs in the merges.
    return [s for pair in pairs for s in pair] + (chat + generic) * 20


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """Train the byte-level BPE on the default task's text and wrap it for transformers.

    Returns a `PreTrainedTokenizerFast` with pad `<|endoftext|>`, eos `<|im_end|>` and the chat
    template; saved next to a qwen2 config it reloads (as `Qwen2Tokenizer`) token for token.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # The same normaliser / pre-tokeniser / decoder as transformers' Qwen2Tokenizer builds.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=None,
        chat_template=CHAT_TEMPLATE, model_max_length=MAX_POSITIONS)


def build_config(size: str = "default", vocab_size: int = VOCAB_SIZE, pad_id: int = 0, eos_id: int = 2):
    """A Qwen2Config of one of `SIZES`; vocab rounded up to a multiple of 64 for matmul shapes."""
    from transformers import Qwen2Config

    if size not in SIZES:
        raise ValueError(f"unknown default model size {size!r}; choose one of {sorted(SIZES)}")
    s = SIZES[size]
    return Qwen2Config(
        vocab_size=-(-vocab_size // 64) * 64, hidden_size=s.hidden, intermediate_size=s.intermediate,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, initializer_range=0.02,
        pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None,
        architectures=["Qwen2ForCausalLM"], dtype="float32")


@torch.no_grad()
def build_model(size: str = "default", seed: int = 0, vocab_size: int = VOCAB_SIZE):
    """A random `Qwen2ForCausalLM`; weights drawn from `seed` alone, in parameter-name order.

    Our own initialisation (normal(0, 0.02) for matrices, ones for norms, zeros for biases) with
    a private generator, so the weights depend neither on the global RNG nor on how a
    transformers version happens to order its init calls.
    """
    from transformers import Qwen2ForCausalLM

    config = build_config(size, vocab_size)
    model = Qwen2ForCausalLM(config).float()
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * config.initializer_range)
    return model.eval()


def build_default(path, size: str = "default", seed: int = 0) -> Path:
    """Write the default model (config, safetensors, tokenizer, generation config) to `path`."""
    from transformers import GenerationConfig

    path = Path(path)
    tokenizer = build_tokenizer()
    pad_id, eos_id = tokenizer.convert_tokens_to_ids([PAD_TOKEN, EOS_TOKEN])
    assert (pad_id, eos_id) == (0, 2), (pad_id, eos_id)
    model = build_model(size, seed, vocab_size=len(tokenizer))
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id,
                                               do_sample=False)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def default_model_dir(size: str = "default", seed: int = 0, cache_dir=None) -> Path:
    """The default model's directory, built on first use into the cache (safe under many ranks
    and runs: cache.build_once)."""
    final = cache_root(cache_dir) / f"default-{size}-seed{seed}-v{FORMAT_VERSION}"
    return build_once(final, lambda tmp: build_default(tmp, size, seed))
