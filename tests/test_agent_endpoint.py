"""Agents written against the official openai client, served by hflow's engine over HTTP
(hflow.agents.endpoint, workers/agent_endpoint.py): real uvicorn on loopback, the real client.

The oracle for the recording is hflow's own Environment path (workers/agent_rollout.py, tested
on its own against the template and the engine): an agent function that says what an
Environment says, turn for turn, must give the same trajectories token for token, log-probs
included. Tool calls are checked against Qwen3's real chat template (tests/fixtures/qwen3) with
a scripted engine: the recorded stream must be the template's own rendering of the conversation.
"""
import json
import threading
import time
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai", reason="the serve extra (openai, uvicorn, starlette) is not installed")

from dist import torchrun  # noqa: E402
from hflow.agents import AgentLimits  # noqa: E402
from hflow.batch import Batch  # noqa: E402
from hflow.engine.sequence import RequestOutput, CompletionOutput  # noqa: E402
from hflow.workers.agent_rollout import sample_agent  # noqa: E402
from hflow.workers.rollout_batches import RolloutConfig  # noqa: E402
from test_agent_rollout import LIMITS, ROLLOUT, FixedTurns, engine, eot_model, rows, tokenizer, trajectories  # noqa: F401,E402


def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="hflow", max_retries=0, timeout=60)


def fixed_turns_agent(row, base_url):
    """FixedTurns (tests/test_agent_rollout.py) as a client loop: three observations as user
    messages, then a last turn, reward 1."""
    c = client(base_url)
    messages = [{"role": "user", "content": row["prompt"]}]
    for left in (3, 2, 1, 0):
        reply = c.chat.completions.create(model="hflow", messages=messages)
        if left == 0:
            return 1.0
        messages.append(reply.choices[0].message)   # the client's own object, sent back as it serialises it
        messages.append({"role": "user", "content": f" observation {left} of row {row['prompt'][:6]}"})


def test_an_agent_function_records_what_the_environment_path_records(eot_model, tokenizer):
    reference = sample_agent(engine(eot_model), rows(4), FixedTurns, ROLLOUT, LIMITS, tokenizer, 0, None)
    served = sample_agent(engine(eot_model), rows(4), fixed_turns_agent, ROLLOUT, LIMITS, tokenizer, 0, None)
    print(served["finish_reason"], served["turns"].tolist())
    assert (served["turns"] > 1).all() and "done" in served["finish_reason"]
    assert trajectories(served) == trajectories(reference)
    for key in ("input_ids", "attention_mask", "response_mask", "turns", "failed", "trajectory_reward"):
        assert torch.equal(served[key], reference[key]), key
    # the same tokens, but the endpoint's requests reach the engine in other batches than the
    # environment's, and a matmul's fp32 rounding follows its rows: 1.4e-6 was seen once in 712
    torch.testing.assert_close(served["rollout_log_probs"], reference["rollout_log_probs"], atol=1e-5, rtol=0)
    assert served["answer"] == reference["answer"] and served["model_text"] == reference["model_text"]
    assert (served["prefix_mismatches"] == 0).all() and (served["unrecorded_turns"] == 0).all()
    assert (served["prefill_tokens"] < served["prompt_tokens"]).all(), "earlier turns' KV came from the prefix cache"


class Spy:
    """What the engine sampled, by request, beside what the client was told."""

    def __init__(self, llm):
        self.llm, self.sampled = llm, {}
        real = llm.step

        def step():
            outs = real()
            for out in outs:
                self.sampled[out.request_id] = (list(out.prompt_token_ids), list(out.outputs[0].token_ids))
            return outs
        llm.step = step


def test_the_client_is_told_the_tokens_the_engine_sampled_and_the_completion_route(eot_model, tokenizer):
    told = {}

    def agent(row, base_url):
        c = client(base_url)
        first = c.completions.create(model="hflow", prompt=tokenizer.encode(row["prompt"]), max_tokens=8)
        ids = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
        second = c.completions.create(model="hflow", prompt=ids + tokenizer.encode(" and then?"), max_tokens=8)
        told[row["prompt"]] = [first, second]
        assert first.choices[0].logprobs.token_logprobs == pytest.approx(
            [x for x in first.choices[0].logprobs.token_logprobs])
        return 0.5

    llm = engine(eot_model)
    spy = Spy(llm)
    batch = sample_agent(llm, rows(2), agent, RolloutConfig(n=1, seed=3, progress=False), LIMITS, tokenizer,
                                  0, None)
    assert batch["turns"].tolist() == [2, 2] and batch["finish_reason"] == ["done", "done"]
    assert batch["trajectory_reward"].tolist() == [0.5, 0.5]
    for i, (prompt, (first, second)) in enumerate(told.items()):
        assert spy.sampled[(f"{i}-0", 0)][1] == first.choices[0].model_extra["token_ids"]
        assert spy.sampled[(f"{i}-0", 1)] == (second.model_extra["prompt_token_ids"],
                                              second.choices[0].model_extra["token_ids"])
        # the trajectory is the second request's prompt and what the engine sampled for it
        stream = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        assert stream == spy.sampled[(f"{i}-0", 1)][0] + spy.sampled[(f"{i}-0", 1)][1]
        lps = batch["rollout_log_probs"][i][batch["response_mask"][i].bool()]
        told_lps = first.choices[0].logprobs.token_logprobs + second.choices[0].logprobs.token_logprobs
        torch.testing.assert_close(lps, torch.tensor(told_lps), atol=1e-6, rtol=0)


def test_a_broken_prefix_is_served_counted_and_never_trained_on(eot_model, tokenizer):
    said = {}

    def editing_agent(row, base_url):
        c = client(base_url)
        messages = [{"role": "user", "content": row["prompt"]}]
        reply = c.chat.completions.create(model="hflow", messages=messages, max_tokens=6)
        messages += [reply.choices[0].message, {"role": "user", "content": "go on"}]
        if row["prompt"].endswith("0 plus 0?"):
            messages[0] = {"role": "user", "content": "an edited question"}   # history rewritten
        elif row["prompt"].endswith("1 plus 1?"):
            messages.insert(2, {"role": "assistant", "content": "words the model never said"})
        second = c.chat.completions.create(model="hflow", messages=messages, max_tokens=6)
        said[row["prompt"]] = second.model_extra["hflow"]   # served all the same, and it says how
        return 1.0

    limits = AgentLimits(max_turns=6, max_response_tokens=160, max_turn_tokens=32)
    batch = sample_agent(engine(eot_model), rows(3), editing_agent, RolloutConfig(n=1, seed=5, progress=False),
                                  limits, tokenizer, 0, None)
    reasons = batch["finish_reason"]
    print(reasons, batch["agent_error"])
    assert reasons[0] == reasons[1] == "prefix_mismatch" and "message 0" in batch["agent_error"][0]
    assert "assistant message of its own" in batch["agent_error"][1]
    assert batch["prefix_mismatches"].tolist()[:2] == [1, 1] and batch["unrecorded_turns"].tolist()[:2] == [1, 1]
    assert (batch["response_mask"][:2] == 0).all(), "nothing of a broken session is trained on"
    assert batch["trajectory_reward"][:2].tolist() == [1.0, 1.0] and not batch["failed"][:2].any()
    assert reasons[2] != "prefix_mismatch" and batch["response_mask"][2].sum() > 0
    assert [said[p]["recorded"] for p in rows(3)["prompt"]] == [False, False, True]
    assert said["what is 0 plus 0?"]["mismatch"].startswith("message 0") and said["what is 2 plus 2?"]["mismatch"] is None


def test_refusals_limits_and_failures_end_their_own_trajectory_only(eot_model, tokenizer):
    errors = {}

    def agent(row, base_url):
        c, kind = client(base_url), row["prompt"].split()[0]
        messages = [{"role": "user", "content": row["prompt"]}]
        if kind == "refused":
            for kwargs in ({"n": 2}, {"logit_bias": {"5": 1}}, {"extra_body": {"best_of": 3}}):
                with pytest.raises(openai.BadRequestError) as e:
                    c.chat.completions.create(model="hflow", messages=messages, **kwargs)
                errors.setdefault(kind, []).append(e.value.body["code"])
            c.chat.completions.create(model="hflow", messages=messages, max_tokens=4)
            return 1.0
        if kind == "loops":   # past max_turns the session ends and the client is told so
            for _ in range(10):
                reply = c.chat.completions.create(model="hflow", messages=messages, max_tokens=3)
                messages += [reply.choices[0].message, {"role": "user", "content": "again"}]
        if kind == "raises":
            c.chat.completions.create(model="hflow", messages=messages, max_tokens=3)
            raise KeyError("the agent's own bug")
        if kind == "sleeps":
            c.chat.completions.create(model="hflow", messages=messages, max_tokens=3)
            time.sleep(120)
        if kind == "per-turn":
            for _ in range(2):
                reply = c.chat.completions.create(model="hflow", messages=messages)
                messages += [reply.choices[0].message, {"role": "user", "content": "again"}]
            return {"turn_rewards": [0.25, 0.5], "tool_calls": 3}
        if kind == "garbage":
            c.chat.completions.create(model="hflow", messages=messages, max_tokens=3)
            return "yes"
        return 1.0

    # (10 s: an agent's first request, its client made on a loaded machine, must come within it)
    limits = AgentLimits(max_turns=3, max_response_tokens=400, max_turn_tokens=32, tool_timeout_s=1, step_timeout_s=10)
    prompts = ["refused a", "loops b", "raises c", "sleeps d", "garbage e", "per-turn f"]
    began = time.monotonic()
    batch = sample_agent(engine(eot_model), Batch({"prompt": prompts}), agent,
                                  RolloutConfig(n=1, seed=2, progress=False), limits, tokenizer, 0, None)
    print(batch["finish_reason"], batch["agent_error"], errors)
    assert time.monotonic() - began < 60, "a sleeping agent costs its own timeout, not its 120 s sleep"
    assert errors["refused"] == ["unsupported"] * 3
    reason = dict(zip(prompts, batch["finish_reason"]))
    # a turn cut by the client's max_tokens ends the recording (the template cannot extend it);
    # the agent's reward stands
    assert reason["refused a"] in ("done", "max_turn_tokens") and batch["trajectory_reward"][0] == 1.0
    assert reason["loops b"] in ("max_turns", "max_turn_tokens", "no_end_of_turn") and not batch["failed"][1]
    assert reason["raises c"] == "env_error" and "KeyError" in batch["agent_error"][2] and batch["failed"][2]
    assert reason["sleeps d"] == "env_timeout" and batch["failed"][3]
    assert reason["garbage e"] == "env_error" and "not a finite number" in batch["agent_error"][4]
    assert batch["trajectory_reward"][1:5].tolist() == [0.0] * 4
    if reason["per-turn f"] == "done":   # unless a turn was cut at max_turn_tokens
        assert batch["turn_rewards"][5] == [0.25, 0.5] and batch["trajectory_reward"][5] == 0.75
        assert batch["tool_calls"][5] == 3


# ---- tool calls under Qwen3's template, the engine scripted

class ScriptedEngine:
    """The surface of hflow.engine.LLM the driver uses, answering each request with the next of
    `turns` (text), its tokens as the tokenizer encodes them plus the end-of-turn token."""

    def __init__(self, tokenizer, turns, eos_ids):
        self.tokenizer, self.turns, self.eos_token_ids = tokenizer, list(turns), eos_ids
        self.max_model_len = 4096
        self.pending, self.prompts = {}, []

    def add_request(self, ids, params, request_id):
        self.pending[request_id] = (list(ids), params)

    def has_unfinished(self):
        return bool(self.pending)

    def abort(self, request_id):
        self.pending.pop(request_id)

    def step(self):
        outs = []
        for request_id, (ids, params) in list(self.pending.items()):
            text = self.turns.pop(0)
            tokens = self.tokenizer.encode(text, add_special_tokens=False) + [self.eos_token_ids[0]]
            self.prompts.append(ids)
            outs.append(RequestOutput(request_id, ids, [CompletionOutput(0, tokens, [-0.5] * len(tokens), "stop",
                                                                         text)], num_cached_tokens=0))
            del self.pending[request_id]
        return outs


CALC = {"type": "function", "function": {"name": "multiply", "description": "a times b",
                                         "parameters": {"type": "object", "properties": {
                                             "a": {"type": "integer"}, "b": {"type": "integer"}},
                                             "required": ["a", "b"]}}}


def test_tool_calls_across_turns_are_the_templates_own_rendering(qwen3):
    tok = qwen3
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    # every assistant turn follows the last user message, so the template keeps each <think> block
    turns = ['<think>\nMultiply first.\n</think>\n\n<tool_call>\n{"name": "multiply", "arguments": {"a": 27, "b": 82}}'
             '\n</tool_call>',
             '<think>\nNow double it.\n</think>\n\nThen <tool_call>\n{"name": "multiply", "arguments": '
             '{"a": 2214, "b": 2}}\n</tool_call>',
             "<think>\nDone.\n</think>\n\nThe answer is 4428."]
    seen = {}

    def agent(row, base_url):
        c = client(base_url)
        messages = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": row["prompt"]}]
        while True:
            reply = c.chat.completions.create(model="hflow", messages=messages, tools=[CALC])
            message = reply.choices[0].message
            messages.append(message)
            if not message.tool_calls:
                seen["messages"], seen["last"] = messages, reply
                return 1.0 if "4428" in message.content else 0.0
            assert reply.choices[0].finish_reason == "tool_calls"
            for call in message.tool_calls:
                args = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] * args["b"])})

    llm = ScriptedEngine(tok, turns, [eot])
    batch = sample_agent(llm, Batch({"prompt": ["27*82*2?"]}), agent, RolloutConfig(n=1, seed=0, progress=False),
                                  AgentLimits(max_turns=5, max_response_tokens=600), tok, 0, None)
    assert batch["finish_reason"] == ["done"] and batch["trajectory_reward"].tolist() == [1.0]
    assert batch["turns"].tolist() == [3]
    # the conversation as a template renders it whole: the oracle for the recorded stream
    conversation = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "27*82*2?"},
                    {"role": "assistant", "content": turns[0]}, {"role": "tool", "content": "2214"},
                    {"role": "assistant", "content": turns[1]}, {"role": "tool", "content": "4428"},
                    {"role": "assistant", "content": turns[2]}]
    rendered = tok.apply_chat_template(conversation, tools=[CALC], tokenize=False)
    stream = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
    assert tok.decode(stream) == rendered.rstrip("\n")
    assert stream == tok.encode(rendered.rstrip("\n"), add_special_tokens=False)
    mask = batch["response_mask"][0][-len(batch["responses"][0]):]
    model_ids = batch["responses"][0][mask.bool()].tolist()
    expected = [i for t in turns for i in tok.encode(t, add_special_tokens=False) + [eot]]
    assert model_ids == expected, "the model's tokens as sampled, observations masked"
    # the tool calls the client got, and the later requests' prompts: the recorded stream so far
    calls = [m.tool_calls[0].function for m in seen["messages"] if not isinstance(m, dict) and m.tool_calls]
    assert [(f.name, json.loads(f.arguments)) for f in calls] == [("multiply", {"a": 27, "b": 82}),
                                                                 ("multiply", {"a": 2214, "b": 2})]
    assert seen["messages"][2].content == "<think>\nMultiply first.\n</think>"
    assert seen["messages"][4].content == "<think>\nNow double it.\n</think>\n\nThen"
    assert llm.prompts[-1] == seen["last"].model_extra["prompt_token_ids"] == stream[:len(llm.prompts[-1])]


def test_one_request_at_a_time_in_a_session(qwen3):
    tok = qwen3
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    release, codes = threading.Event(), []

    class Held(ScriptedEngine):
        def step(self):   # the first request stays on the engine until the second was answered
            if not release.is_set():
                time.sleep(0.01)
                return []
            return super().step()

    llm = Held(tok, ["one", "two"], [eot])

    def agent(row, base_url):
        c = client(base_url)
        messages = [{"role": "user", "content": "hi"}]
        first = threading.Thread(target=lambda: c.chat.completions.create(model="hflow", messages=messages))
        first.start()
        while not llm.pending:
            time.sleep(0.01)
        try:
            c.chat.completions.create(model="hflow", messages=messages)
        except openai.APIStatusError as e:
            codes.append(e.status_code)
        release.set()
        first.join()
        return 1.0

    batch = sample_agent(llm, Batch({"prompt": ["x"]}), agent, RolloutConfig(n=1, seed=0, progress=False),
                                  AgentLimits(), tok, 0, None)
    assert codes == [409] and batch["turns"].tolist() == [1]


# ---- the recipe: an openai-client agent trains as the built-in environment it re-implements

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "openai_calculator.py")
RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "agent.py")
# the engine's log-probs depend (at 1e-7) on which requests decode together, which HTTP timing moves
ENGINE_GAP = ("actor/mismatch/", "time/", "throughput/", "memory/")


@pytest.mark.dist
def test_the_openai_calculator_example_trains_exactly_as_the_builtin_calculator(tmp_path):
    """examples/openai_calculator.py plays the embedded default's calculator task through the
    endpoint's token-in/token-out route; recipes/agent.py with it must log every figure the
    built-in `calculator` environment logs: rewards, loss, gradient norm, held-out reward, turns,
    tool calls. The embedded default's starting policy calls the calculator now and then, so the
    tool path is exercised."""
    def run(env, name):
        out = tmp_path / name
        torchrun(RECIPE, 2, ["--agent.env", env, "--trainer.output-dir", out, "--trainer.steps", 2,
                             "--data.batch-size", 8, "--rollout.n", 4, "--trainer.eval-size", 32,
                             "--trainer.logging.no-progress-bars", "--trainer.no-export"], timeout=600).check()
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    builtin, served = run("calculator", "builtin"), run(f"{EXAMPLE}:solve", "served")
    assert len(builtin) == len(served) == 3
    assert sum(row.get("agent/tool_calls", 0) for row in builtin) > 0, "no tool call: the test shows little"
    for b, s in zip(builtin, served):
        assert {k for k in s if "prefix_mismatches" in k or "unrecorded_turns" in k} and \
            all(v == 0 for k, v in s.items() if "prefix_mismatches" in k or "unrecorded_turns" in k)
        s = {k: v for k, v in s.items() if "prefix_mismatches" not in k and "unrecorded_turns" not in k}
        assert {k: v for k, v in b.items() if not k.startswith(ENGINE_GAP)} == \
            {k: v for k, v in s.items() if not k.startswith(ENGINE_GAP)}


def test_a_served_rollout_records_each_turns_policy_version(eot_model, tokenizer):  # noqa: F811
    """As a rollout group's generate_agent runs it (workers/rollout.py): versions per turn, and
    between_steps called while the agents work. The version moves to 4 once two turns are done,
    as if new weights were taken there (the engine's weight_changes stay empty)."""
    version, calls, answered = [3], [], []
    llm = engine(eot_model)
    step = llm.step

    def counting_step():
        outs = step()
        answered.extend(outs)
        return outs
    llm.step = counting_step

    def between():
        calls.append(1)
        if len(answered) >= 2:
            version[0] = 4
    batch = sample_agent(llm, rows(2), fixed_turns_agent, ROLLOUT, LIMITS, tokenizer, 0, None,
                         version=lambda: version[0], between_steps=between)
    assert calls
    seen = []
    for b in range(len(batch)):
        turns = batch["turn_policy_version"][b][:batch["turns"][b]].tolist()
        assert set(turns) <= {3, 4} and turns == sorted(turns) and batch["policy_version"][b] == turns[0]
        assert (batch["turn_policy_version"][b][batch["turns"][b]:] == -1).all()
        seen += turns
    assert seen.count(3) >= 2 and 4 in seen, seen


TP = '''
import json, sys
import hflow
from hflow.agents import AgentLimits
from hflow.batch import Batch
from hflow.workers import Actor, ActorConfig, RolloutConfig
import openai

path, out = sys.argv[1], sys.argv[2]


def solve(row, base_url):   # in __main__ on every rank, so the spec pickles
    import torch.distributed as dist
    with open(out + ".ranks", "a") as f:
        print(dist.get_rank(), file=f)
    c = openai.OpenAI(base_url=base_url, api_key="hflow", max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    for left in (2, 1, 0):
        reply = c.chat.completions.create(model="hflow", messages=messages)
        if left == 0:
            return 1.0
        messages += [reply.choices[0].message, {"role": "user", "content": f" observation {left}"}]


def main(cluster, _):
    actor = cluster.spawn(Actor, ActorConfig(model_path=path))
    rows = Batch({"prompt": [f"what is {i} plus {i}?" for i in range(4)]})
    limits = AgentLimits(max_turns=6, max_response_tokens=160, max_turn_tokens=32)
    found = {}
    for tp in (1, 2):
        rollout = RolloutConfig(n=2, seed=7, progress=False, kv_cache_bytes=64 << 20, block_size=4, tp_size=tp)
        batch = actor.generate_agent(rows, solve, rollout, limits)
        real = batch["attention_mask"].bool()
        found[tp] = {"trajectories": [r[m].tolist() for r, m in zip(batch["input_ids"], real)],
                     "finish": batch["finish_reason"], "turns": batch["turns"].tolist(),
                     "ranks": sorted(set(open(out + ".ranks").read().split()))}
        open(out + ".ranks", "w").close()
    json.dump(found, open(out, "w"))


if __name__ == "__main__":
    hflow.launch(main)
'''


@pytest.mark.dist
def test_served_agents_at_tp_2_are_those_of_tp_1(eot_model, tmp_path):  # noqa: F811
    """At tp 2 the group's leader serves both ranks' sessions (the followers replay its engine
    steps): the same trajectories as at tp 1, where each rank serves its own."""
    out = tmp_path / "tp.json"
    torchrun(TP, 2, [eot_model, out], tmp_path=tmp_path, timeout=400, env={"HFLOW_DEVICE": "cpu"}).check()
    found = json.loads(out.read_text())
    one, two = found["1"], found["2"]
    assert one["trajectories"] == two["trajectories"] and one["finish"] == two["finish"]
    assert max(one["turns"]) > 1 and "done" in one["finish"]
    assert one["ranks"] == ["0", "1"] and two["ranks"] == ["0"]


def test_a_streamed_request_gets_the_whole_turn_as_events(qwen3):
    """Agent libraries that stream (verifiers' harnesses do) read the same turn: one delta with
    the message and its tool calls, the finish reason, the usage when asked; recorded as usual."""
    tok = qwen3
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    turns = ['<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>', "It is 12."]
    got = {}

    def agent(row, base_url):
        c = client(base_url)
        messages = [{"role": "user", "content": "3*4?"}]
        chunks = list(c.chat.completions.create(model="hflow", messages=messages, tools=[CALC], stream=True,
                                                stream_options={"include_usage": True}))
        got["first"] = chunks
        calls = chunks[0].choices[0].delta.tool_calls
        messages += [{"role": "assistant", "content": chunks[0].choices[0].delta.content,
                      "tool_calls": [{"id": t.id, "type": "function",
                                      "function": {"name": t.function.name, "arguments": t.function.arguments}}
                                     for t in calls]},
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "12"}]
        got["second"] = list(c.chat.completions.create(model="hflow", messages=messages, tools=[CALC], stream=True))
        return 1.0

    batch = sample_agent(ScriptedEngine(tok, turns, [eot]), Batch({"prompt": ["3*4?"]}), agent,
                         RolloutConfig(n=1, seed=0, progress=False), AgentLimits(), tok, 0, None)
    first = got["first"]
    assert [c.choices[0].finish_reason if c.choices else "usage" for c in first] == [None, "tool_calls", "usage"]
    call = first[0].choices[0].delta.tool_calls[0]
    assert (call.index, call.function.name, json.loads(call.function.arguments)) == (0, "multiply", {"a": 3, "b": 4})
    assert first[2].usage.completion_tokens == len(tok.encode(turns[0], add_special_tokens=False)) + 1
    assert got["second"][0].choices[0].delta.content == "It is 12."
    assert batch["finish_reason"] == ["done"] and batch["turns"].tolist() == [2] and batch["prefix_mismatches"][0] == 0


async def async_fixed_turns_agent(row, base_url):
    """fixed_turns_agent written with AsyncOpenAI: every async agent of a process runs on one
    event loop (agent_function._shared_loop), side by side."""
    c = openai.AsyncOpenAI(base_url=base_url, api_key="hflow", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": row["prompt"]}]
    for left in (3, 2, 1, 0):
        reply = await c.chat.completions.create(model="hflow", messages=messages)
        if left == 0:
            return 1.0
        messages += [reply.choices[0].message, {"role": "user", "content": f" observation {left} of row {row['prompt'][:6]}"}]


def test_async_agents_share_one_loop_and_record_what_sync_ones_do(eot_model, tokenizer):  # noqa: F811
    sync = sample_agent(engine(eot_model), rows(4), fixed_turns_agent, ROLLOUT, LIMITS, tokenizer, 0, None)
    served = sample_agent(engine(eot_model), rows(4), async_fixed_turns_agent, ROLLOUT, LIMITS, tokenizer, 0, None)
    assert trajectories(served) == trajectories(sync) and served["finish_reason"] == sync["finish_reason"]


def test_an_agent_retrying_a_refused_request_for_ever_is_stopped_by_its_timeout(qwen3):
    eot = qwen3.convert_tokens_to_ids("<|im_end|>")
    refusals = []

    def stubborn(row, base_url):
        c = client(base_url)
        messages = [{"role": "user", "content": "hi"}]
        reply = c.chat.completions.create(model="hflow", messages=messages)
        messages += [reply.choices[0].message, {"role": "user", "content": "more"}]
        while True:   # max_turns is 1: every further request is refused, and it never gives up
            try:
                c.chat.completions.create(model="hflow", messages=messages)
            except openai.BadRequestError as e:
                refusals.append(e.body["code"])

    began = time.monotonic()
    batch = sample_agent(ScriptedEngine(qwen3, ["hello"], [eot]), Batch({"prompt": ["x"]}), stubborn,
                         RolloutConfig(n=1, seed=0, progress=False),
                         AgentLimits(max_turns=1, tool_timeout_s=1, step_timeout_s=3), qwen3, 0, None)
    assert time.monotonic() - began < 30 and len(refusals) > 3 and set(refusals) == {"session_ended"}
    # it was told its session had ended: the limit, not a failure, is how its trajectory ends
    assert batch["finish_reason"] == ["max_turns"] and not batch["failed"][0] and batch["turns"].tolist() == [1]
