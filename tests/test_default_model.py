"""The embedded default model and tokenizer: reload exactly, tokenise arithmetic sensibly, build
deterministically."""
import hashlib
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hflow.default import model as dm, warm_up

SAMPLES = [
    "12+35=", "47", "12-35=", "-23", "12-35=-23", "99+99=198", "0123456789", " 7  8   9 ",
    "What is 12 + 35? The answer is 47.", "héllo wörld  日本語 \n\n x\r\ny\tz", "naïve café ½ 🙂",
    "don't I'LL we've", "<|im_start|>user\n12+35=<|im_end|>\n<|im_start|>assistant\n47<|im_end|>",
    "  leading and trailing   ", "",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path = tmp_path_factory.mktemp("default_tiny")
    dm.build_default(path, size="tiny", seed=0)
    return path


def test_saved_tokenizer_reloads_token_for_token(built):
    in_memory = dm.build_tokenizer()
    reloaded = AutoTokenizer.from_pretrained(built)
    assert len(in_memory) == len(reloaded) == dm.VOCAB_SIZE
    for text in SAMPLES:
        ids = in_memory.encode(text)
        assert reloaded.encode(text) == ids, text
        assert reloaded.decode(ids) == in_memory.decode(ids) == text
    assert (reloaded.eos_token, reloaded.pad_token) == (dm.EOS_TOKEN, dm.PAD_TOKEN)
    assert (reloaded.eos_token_id, reloaded.pad_token_id) == (2, 0)
    # Special tokens are single ids, also when they appear inside text.
    ids = reloaded.encode("47<|im_end|>")
    assert ids[-1] == reloaded.eos_token_id and len(ids) == 3


def test_chat_template_matches_qwen_layout(built):
    tok = AutoTokenizer.from_pretrained(built)
    messages = [{"role": "user", "content": "12+35="}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n12+35=<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, tokenize=False) == "<|im_start|>user\n12+35=<|im_end|>\n"


def test_digits_are_single_tokens_and_answers_concatenate(built):
    tok = AutoTokenizer.from_pretrained(built)
    assert tok.convert_ids_to_tokens(tok.encode("12+35=")) == ["1", "2", "+", "3", "5", "="]
    assert tok.convert_ids_to_tokens(tok.encode("-23")) == ["-", "2", "3"]
    # Tokenising prompt and answer apart gives the same ids as tokenising them together, so a
    # completion sampled token by token decodes to the text a reward function reads.
    for prompt, answer in dm.task_pairs(500, seed=123):
        assert tok.encode(prompt) + tok.encode(answer) == tok.encode(prompt + answer), prompt + answer


def test_model_loads_and_matches_in_memory_build(built):
    model = AutoModelForCausalLM.from_pretrained(built)
    ref = dm.build_model("tiny", seed=0)
    cfg = model.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers) == ("qwen2", 64, 2)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 512 and cfg.max_position_embeddings == 256
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.generation_config.eos_token_id == 2 and model.generation_config.pad_token_id == 0
    ids = torch.tensor([AutoTokenizer.from_pretrained(built).encode("12+35=47")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)
    out = model.generate(ids, max_new_tokens=3, do_sample=False)   # transformers accepts it as is
    assert out.shape[1] <= ids.shape[1] + 3


def test_sizes_have_the_advertised_shapes():
    counts = {size: sum(p.numel() for p in dm.build_model(size).parameters()) for size in ("tiny", "default")}
    assert counts["tiny"] < 200_000 and 3_500_000 < counts["default"] < 4_500_000
    cfg = dm.build_config("25m")
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (512, 8)
    with pytest.raises(ValueError, match="choose one of"):
        dm.build_config("huge")


def _digests(path):
    return {name: hashlib.sha256((path / name).read_bytes()).hexdigest() for name in sorted(os.listdir(path))}


def test_same_seed_gives_byte_identical_files(built, tmp_path):
    # Another process, with another hash seed and global RNG state: only `seed` may matter.
    code = ("import sys, torch; torch.manual_seed(1234); from hflow.default.model import build_default;"
            "build_default(sys.argv[1], size='tiny', seed=0)")
    env = {**os.environ, "PYTHONHASHSEED": "7"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "again")], check=True, env=env,
                   timeout=300)
    assert _digests(tmp_path / "again") == _digests(built)
    other = dm.build_model("tiny", seed=1)
    assert not torch.equal(other.model.embed_tokens.weight, dm.build_model("tiny", seed=0).model.embed_tokens.weight)


def test_default_model_dir_builds_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HFLOW_CACHE", str(tmp_path))
    path = dm.default_model_dir("tiny", seed=0)
    assert path.parent == tmp_path and (path / "model.safetensors").exists()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert dm.default_model_dir("tiny", seed=0) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]     # no temporary left behind


def test_concurrent_builds_of_the_cache_agree(tmp_path):
    # Every rank of a fresh run may call default_model_dir at once: all must get a whole model.
    code = ("import sys; from hflow.default.model import default_model_dir;"
            "print(default_model_dir('tiny', seed=3, cache_dir=sys.argv[1]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and len(set(outs)) == 1, outs
    assert [p.name for p in tmp_path.iterdir()] == ["default-tiny-seed3-v1"]
    assert AutoModelForCausalLM.from_pretrained(outs[0]).config.hidden_size == 64


def test_warm_up_cache_is_reused_only_under_its_current_name(tmp_path):
    # A cache written by an earlier warm-up (other settings, e.g. "-sft0.4") must not be served as
    # today's policy: default_policy warms up again (here: reaches cluster.spawn) instead.

    class NoWorkers:
        def spawn(self, *args, **kwargs):
            raise LookupError("would warm up")

    base = dm.default_model_dir("tiny", seed=0, cache_dir=tmp_path)
    old = base.with_name(f"{base.name}-sft0.4")
    old.mkdir()
    (old / "config.json").write_text("{}")
    current = warm_up.default_policy_dir("tiny", 0, cache_dir=tmp_path)
    assert current.parent == tmp_path and current != old
    assert current.name.endswith(f"-w{warm_up.WARM_UP_VERSION}")
    with pytest.raises(LookupError, match="would warm up"):
        warm_up.default_policy(NoWorkers(), "tiny", 0, cache_dir=tmp_path)
    current.mkdir()
    (current / "config.json").write_text("{}")
    assert warm_up.default_policy(NoWorkers(), "tiny", 0, cache_dir=tmp_path) == current


def test_build_once_leaves_nothing_behind_a_failed_build_and_replaces_a_leftover(tmp_path):
    from hflow.default.cache import build_once

    def fails(out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("the warm-up did not reach its accuracy")

    with pytest.raises(RuntimeError, match="did not reach"):
        build_once(tmp_path / "model", fails)
    assert list(tmp_path.iterdir()) == []            # no half-built model, no temporary
    leftover = tmp_path / "model"
    leftover.mkdir()
    (leftover / "stray.bin").write_text("x")         # not a model: no config.json
    calls = []

    def builds(out):
        calls.append(out)
        (out / "config.json").write_text('{"ok": 1}')

    assert build_once(leftover, builds) == leftover and (leftover / "config.json").read_text() == '{"ok": 1}'
    assert not (leftover / "stray.bin").exists() and build_once(leftover, builds) == leftover and len(calls) == 1
