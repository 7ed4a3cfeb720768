"""The trainer (the FSDP2 Actor) on real weights across ranks: SmolLM2-135M-Instruct (the
`smollm2_dir` fixture of conftest.py: a Llama of 30 layers with tied embeddings) in fp32, every
parameter sharded over 2 ranks, against transformers' own forward and a hand-written AdamW step.
tests/test_pretrained.py checks the engine alone on these weights, tests/test_fsdp.py the trainer
on tiny random models; here the two meet on a real checkpoint:

1. the actor's log-probs of chat-formatted GRPO groups equal transformers' log_softmax;
2. one update (the recipes' policy loss, fixed advantages, token-mean over micro-batches and
   ranks) steps with transformers' own gradient of the same loss — the tied embedding's the sum of
   its head and lookup parts — and the exported weights are one AdamW step of it;
3. the engine, fed the updated shards by the hybrid engine, samples with log-probs equal to the
   trainer's and to transformers' forward of the exported weights.

The ranks (tests/programs/real_model_training.py) run once for the module, ~40 s on 2 cores."""
import os

import pytest
import torch
from dist import PROGRAMS, torchrun
from test_fsdp import TESTS_ENV

from hflow.layout import sequence_tensors

N = 2                  # samples per prompt: the two rows of a prompt are a GRPO group
LR = 1e-4              # AdamW's first step moves a weight by lr * g / (|g| + eps): ~1e-4, visible
EPS = 1e-8             # AdamW's (OptimConfig's default)
MICRO_BATCH_SIZE = 4   # 6 rows a rank: 2 micro-batches of 3, the second prompt's group cut in two
TEMPERATURE = 0.7      # the rollout's after the update
# fp32 on this model: transformers' own fp32 forward is 6.7e-5 from its fp64 forward on CHATS'
# tokens, the actor 2.2e-5 from transformers' fp32 (measured); a wrong weight, mask or position
# moves a log-prob by 1e-2 or more
TOLERANCE_LOG_PROBS = 1e-4

# (system prompt or None, user message, the two responses); a response without "<eos>" was cut
# by max_tokens, as a rollout's can be
CHATS = [
    (None, "What is the capital of France?",
     ("The capital of France is Paris.<eos>", "Paris.<eos>")),
    ("You are a concise math tutor.", "What is 12 times 7?",
     ("12 times 7 is 84.<eos>", "Let me compute it step by step: 12 x 7 = 70 + 14 = 84. So the answer is 84.<eos>")),
    (None, "Name the three primary colors.",
     ("Red, yellow and blue.<eos>", "The three primary colors are red, yellow, and")),
    (None, "How do you say 'thank you' in Spanish?",
     ("Gracias.<eos>", "In Spanish, 'thank you' is 'gracias'. You can also say 'muchas gracias'.<eos>")),
    ("Answer in one word.", "Is the sun a star?",
     ("Yes.<eos>", "Yes<eos>")),
    (None, "Give me a synonym for happy.",
     ("Joyful.<eos>", "A common synonym for happy is cheerful, and another is content.<eos>")),
]
# one a row, constant over its tokens (GRPO's: a group's two samples on either side of their mean)
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, -1.5, 1.5, 0.7, -0.7, 1.2, -1.2, -0.3, 0.3]


def chat_rollouts(model_dir: str):
    """CHATS in SmolLM2's chat template (its default system prompt where a chat has none) in the
    batch layout of hflow/layout.py, N rows a prompt, a prompt's rows adjacent, with `advantages`
    [B, R]; and the prompts' token ids, one list a prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = tokenizer.eos_token_id
    prompts, rows, responses = [], [], []
    for system, user, answers in CHATS:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts.append(prompt)
        for answer in answers:
            ids = tokenizer(answer.removesuffix("<eos>"), add_special_tokens=False)["input_ids"]
            rows.append(prompt)
            responses.append(ids + [eos] * answer.endswith("<eos>"))
    tensors = sequence_tensors(rows, responses, pad_id=tokenizer.pad_token_id)
    tensors["advantages"] = torch.tensor(ADVANTAGES)[:, None] * tensors["response_mask"]
    return tensors, prompts


def row_tokens(tensors, i: int) -> tuple[torch.Tensor, int]:
    """Row i's real tokens (prompt and response, no padding) and its prompt's length."""
    R = tensors["response_mask"].shape[1]
    mask = tensors["attention_mask"][i].bool()
    return tensors["input_ids"][i][mask], int(mask[:-R].sum())


def oracle_log_probs(model, tensors, temperature: float = 1.0, embeddings_detached: bool = False):
    """transformers' log_softmax at each row's response tokens, one unpadded forward a row (no
    mask, no position ids to get wrong); `embeddings_detached`: the lookup's output cut from the
    graph, so that a tied weight's gradient is its head's part alone."""
    out = []
    for i in range(len(tensors["input_ids"])):
        ids, p = row_tokens(tensors, i)
        if embeddings_detached:
            logits = model(inputs_embeds=model.get_input_embeddings()(ids[None]).detach()).logits
        else:
            logits = model(input_ids=ids[None]).logits
        logits = logits[0, p - 1:-1].float()
        out.append(torch.log_softmax(logits / temperature, -1).gather(-1, ids[p:, None])[:, 0])
    return out


def as_rows(values: torch.Tensor, tensors) -> list[torch.Tensor]:
    """[B, R] values -> each row's values at its response tokens."""
    return [v[m.bool()] for v, m in zip(values, tensors["response_mask"])]


def loss_and_gradient(model, tensors, **kwargs):
    """The update's loss, on-policy: -A * pi / sg(pi), a mean over every response token of the
    batch (token-mean over the whole mini-batch, as Actor.update aggregates its micro-batches
    and ranks), and its gradient {name: tensor} (the tied weight once: autograd sums its parts)."""
    model.zero_grad(set_to_none=True)
    tokens = tensors["response_mask"].sum()
    total = 0.0
    for logp, adv in zip(oracle_log_probs(model, tensors, **kwargs), as_rows(tensors["advantages"], tensors)):
        loss = -(adv * torch.exp(logp - logp.detach())).sum() / tokens
        loss.backward()
        total += loss.item()
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return total, grads


def adamw_first_step(weight: torch.Tensor, grad: torch.Tensor, lr: float = LR, betas=(0.9, 0.999),
                     eps: float = EPS) -> torch.Tensor:
    """torch.optim.AdamW's first step, written out (weight decay 0, OptimConfig's default):
    m = (1 - b1) g, v = (1 - b2) g^2, bias-corrected m / (1 - b1) = g, v / (1 - b2) = g^2."""
    m_hat = (1 - betas[0]) * grad / (1 - betas[0])
    v_hat = (1 - betas[1]) * grad * grad / (1 - betas[1])
    return weight - lr * m_hat / (v_hat.sqrt() + eps)


REAL = os.path.join(PROGRAMS, "real_model_training.py")


@pytest.fixture(scope="module")
def run(smollm2_dir, tmp_path_factory):
    """The ranks' results (results.pt and grads.pt, memory-mapped) and the exported directory."""
    out = tmp_path_factory.mktemp("real_model_training")
    ranks = torchrun(REAL, nproc=2, args=[smollm2_dir, out], tmp_path=out, timeout=420, env=TESTS_ENV).check()
    assert ranks.output.count("engine vs training weights 0.00e+00") == 2, ranks.output
    saved = torch.load(out / "results.pt", mmap=True) | {"grads": torch.load(out / "grads.pt", mmap=True)}
    return saved, out / "exported"


@pytest.fixture(scope="module")
def oracle(smollm2_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight   # tied
    return model.eval()   # no dropout either way (SmolLM2 has none; hflow sets every dropout to 0)


@pytest.mark.dist
def test_log_probs_of_chat_groups_equal_transformers(run, oracle, smollm2_dir):
    saved, _ = run
    tensors, _ = chat_rollouts(smollm2_dir)
    with torch.no_grad():
        expect = oracle_log_probs(oracle, tensors)
    got = as_rows(saved["log_probs"], tensors)
    assert [len(g) for g in got] == [len(e) for e in expect] and len(set(map(len, got))) > 5   # lengths vary
    diff = max((g - e).abs().max().item() for g, e in zip(got, expect))
    print(f"log-probs of {sum(map(len, got))} response tokens: max |actor - transformers| {diff:.2e}")
    assert diff <= TOLERANCE_LOG_PROBS
    assert (saved["log_probs"][tensors["response_mask"] == 0] == 0).all()


@pytest.mark.dist
def test_one_update_is_one_adamw_step_on_transformers_gradient(run, oracle, smollm2_dir):
    """The gradient against transformers' autograd of the same loss, then the exported weights
    against one AdamW step written out by hand.

    Tolerances, fp32: the gradient of each tensor within 2e-4 of transformers' in norm and each
    element within 5e-4 of the tensor's largest (measured 4.5e-5 and 1.1e-4: the network's own
    fp32 rounding. Against an fp64 forward and backward the worst tensor is 5.0e-5 off for the
    actor, 5.5e-5 for transformers' fp32 forward with an exact (fp64) log-softmax, 2.1e-5 with
    torch's fp32 one; a token-mean per micro-batch instead of over the mini-batch is 0.37 off
    in norm). Adam's first step is lr * g / (|g| + eps),
    ~lr * sign(g): the same step for the same gradient up to the weights' rounding, but where
    |g| is at the level of fp32 noise (an embedding row of a token nowhere in the batch, an
    element that cancels) the rounding of g decides the sign. So the exported weights are
    checked (a) against the step on the actor's own gradient, every element, to rounding (one
    step, lr 1e-4, no clipping, nothing else); (b) against the step on transformers' gradient,
    to 1e-5 relative (the brief's fp32 bound; measured 6.7e-7), on every element whose gradient
    is at least 1e-5 = 1000 eps, where the step's sensitivity lr * eps / g^2 <= 1e-2 makes a
    gradient error of fp32's size invisible; every other element within the 2 lr a sign
    flip can give."""
    from safetensors.torch import load_file

    saved, exported = run
    tensors, _ = chat_rollouts(smollm2_dir)
    loss, grads = loss_and_gradient(oracle, tensors)
    hflow_grads = saved["grads"]
    assert hflow_grads.keys() == grads.keys() and "lm_head.weight" not in grads   # the tied weight once
    metrics = saved["metrics"]
    assert metrics["actor/loss"] == pytest.approx(loss, rel=1e-5)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    assert metrics["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    worst_norm, worst_element = (0.0, ""), (0.0, "")
    for name, g in grads.items():
        h = hflow_grads[name]
        worst_norm = max(worst_norm, (((h - g).norm() / g.norm()).item(), name))
        worst_element = max(worst_element, (((h - g).abs().max() / g.abs().max()).item(), name))
    print(f"gradient vs transformers': worst tensor in norm {worst_norm[0]:.1e} ({worst_norm[1]}), "
          f"worst element / its tensor's largest {worst_element[0]:.1e} ({worst_element[1]}); "
          f"loss {metrics['actor/loss']:.6f} vs {loss:.6f}, norm {metrics['actor/grad_norm']:.5f} vs {norm:.5f}")
    assert worst_norm[0] <= 2e-4 and worst_element[0] <= 5e-4, (worst_norm, worst_element)

    # the tied weight: the sum of the head's part and the lookup's, neither alone
    name = "model.embed_tokens.weight"
    oracle.requires_grad_(False)
    oracle.model.embed_tokens.weight.requires_grad_(True)   # its gradient alone (memory)
    try:
        head_part = loss_and_gradient(oracle, tensors, embeddings_detached=True)[1][name]
    finally:
        oracle.requires_grad_(True)
    lookup_part = grads[name] - head_part
    # the tokens whose lookup feeds a prediction: all but each row's last
    looked_up = torch.unique(torch.cat([row_tokens(tensors, i)[0][:-1] for i in range(len(ADVANTAGES))])).tolist()
    pad = oracle.config.pad_token_id   # SmolLM2's pad is its <|im_end|>, in every prompt
    assert pad in looked_up and oracle.model.embed_tokens.padding_idx == pad
    # transformers' nn.Embedding(padding_idx) and hflow's in-place path both leave the pad row's
    # lookup out: <|im_end|> learns its input embedding from the head's part only
    assert torch.equal(lookup_part[pad], torch.zeros_like(lookup_part[pad]))
    assert lookup_part.abs().sum(-1).nonzero().flatten().tolist() == [t for t in looked_up if t != pad]
    tolerance = 2e-4 * grads[name].norm()
    for part, what in ((head_part, "the head's"), (lookup_part, "the lookup's")):
        apart = (hflow_grads[name] - part).norm()
        assert apart > 100 * tolerance, f"the tied weight's gradient is {what} part alone"
    assert (hflow_grads[name] - head_part - lookup_part).norm() <= tolerance
    del head_part, lookup_part

    # the exported weights: one AdamW step
    start = {n: p.detach() for n, p in oracle.named_parameters()}
    weights = {}
    for file in sorted(exported.glob("*.safetensors")):
        weights |= load_file(file)
    assert weights.keys() == grads.keys()   # the tied head is not written twice
    on_own, on_oracle_determined, on_oracle_any, undetermined, moved = 0.0, 0.0, 0.0, 0, 0.0
    for name, g in grads.items():
        w, w0 = weights[name], start[name]
        own = adamw_first_step(w0, hflow_grads[name])
        on_own = max(on_own, ((w - own).abs() / (w0.abs() + LR)).max().item())
        hand = adamw_first_step(w0, g)
        determined = g.abs() >= 1e3 * EPS
        torch.testing.assert_close(w[determined], hand[determined], rtol=1e-5, atol=1e-9,
                                   msg=lambda m: f"{name}: {m}")
        if determined.any():
            on_oracle_determined = max(on_oracle_determined,
                                       ((w - hand).abs() / hand.abs().clamp(min=1e-3))[determined].max().item())
        on_oracle_any = max(on_oracle_any, (w - hand).abs().max().item())
        undetermined += int((~determined).sum())
        # at most one step, lr, to the rounding of the weight (a float32 ulp is 2^-23 |w| at most)
        step = (w - w0).abs()
        assert (step <= LR + 2 ** -23 * w0.abs()).all(), f"{name} moved by more than lr: {step.max().item()}"
        moved = max(moved, step.max().item())
    total = sum(g.numel() for g in grads.values())
    print(f"exported weights: vs the step on the actor's gradient {on_own:.1e} (relative to |w| + lr); "
          f"vs the step on transformers' {on_oracle_determined:.1e} (relative) on the "
          f"{total - undetermined} elements with |g| >= 1000 eps, {on_oracle_any:.1e} at most on all; "
          f"largest move {moved:.3e} (lr {LR})")
    assert on_own <= 1e-6    # to rounding: |w| + lr is never above 4 here, a float32 ulp at 4 is 4.8e-7
    assert on_oracle_any <= 2 * LR * (1 + 1e-3)
    assert moved >= LR * (1 - 1e-3)   # visible
    assert undetermined < total / 3


@pytest.mark.dist
def test_the_engine_samples_from_the_updated_weights(run, oracle, smollm2_dir):
    """The rollout after the update: its log-probs equal the trainer's recomputed ones (as the
    ranks check too) and transformers' forward of the exported weights, within
    TOLERANCE_LOG_PROBS; an engine with the weights before the update, or with its tied head
    left behind while the embedding moved, would be 1e-3 or more away."""
    from transformers import AutoModelForCausalLM

    saved, exported = run
    rollout = saved["rollout"]
    mask = rollout["response_mask"].bool()
    assert len(mask) == len(CHATS) * N and int(mask.sum()) >= 4 * len(mask)
    engine = rollout["rollout_log_probs"][mask]
    trainer = (rollout["recomputed"][mask] - engine).abs().max().item()

    updated = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    assert updated.lm_head.weight is updated.model.embed_tokens.weight
    with torch.no_grad():
        def against(model):
            return (torch.cat(oracle_log_probs(model, rollout, TEMPERATURE)) - engine).abs().max().item()
        exported_diff, before = against(updated), against(oracle)
        updated.lm_head.weight = torch.nn.Parameter(oracle.lm_head.weight.detach().clone())   # untied, stale
        stale_head = against(updated)
    print(f"engine log-probs of {int(mask.sum())} sampled tokens: vs the trainer's {trainer:.1e}, vs transformers "
          f"on the exported weights {exported_diff:.1e}; on the weights before the update {before:.1e}, "
          f"with the head before it {stale_head:.1e}")
    assert trainer <= TOLERANCE_LOG_PROBS and exported_diff <= TOLERANCE_LOG_PROBS
    assert before >= 10 * TOLERANCE_LOG_PROBS and stale_head >= 10 * TOLERANCE_LOG_PROBS
