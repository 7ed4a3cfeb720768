"""examples/agent_envs.py, docs/agents.md's environment and tool, played through real sessions."""
import json
from pathlib import Path

from hflow.agents import AgentSession, ChatRenderer, TextRenderer, load_environment, run_episode
from hflow.default.model import build_tokenizer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agent_envs.py"


class Script:
    def __init__(self, tok, turns):
        self.tok, self.turns = tok, list(turns)

    def __call__(self, prompt_ids, max_new_tokens):
        ids = self.tok.encode(self.turns.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
        return ids, [-0.5] * len(ids)


def test_guess_tells_higher_or_lower_and_pays_on_the_number():
    tok = build_tokenizer()
    env = load_environment(f"{EXAMPLES}:Guess")()
    t = run_episode(AgentSession(env, TextRenderer(tok), {"answer": "42"}), Script(tok, ["50", "x", "42"]))
    observations = [tok.decode(s.token_ids) for s in t.segments if not s.from_model]
    assert observations == ["lower\n", "higher\n"] and t.reward() == 1.0 and t.counts["wrong_guesses"] == 2


def test_units_quiz_runs_its_tool_in_the_chat_template_and_scores_the_answer():
    tok = build_tokenizer()   # a chat template without tools: the renderer still takes the messages
    env = load_environment(f"{EXAMPLES}:UnitsQuiz")()
    assert env.tool_schemas()[0]["function"]["parameters"]["required"] == ["value", "unit"]
    call = '<tool_call>{"name": "to_metres", "arguments": {"value": 3, "unit": "ft"}}</tool_call>'
    bad = '<tool_call>{"name": "to_metres", "arguments": {"value": 3, "unit": "yd"}}</tool_call>'
    row = {"prompt": [{"role": "user", "content": "How many metres is 3 ft?"}], "answer": "0.9144"}
    t = run_episode(AgentSession(env, ChatRenderer(tok), row), Script(tok, [bad, call, "0.9144"]))
    observations = [tok.decode(s.token_ids) for s in t.segments if not s.from_model]
    assert "unknown unit 'yd'" in observations[0] and "0.9144" in observations[1]
    assert t.finish_reason == "done" and t.reward() == 1.0
    assert t.counts["tool_calls"] == 2 and t.counts["bad_tool_calls"] == 1
    json.dumps(env.tool_schemas())   # what goes to the template's tools=


def test_tool_prompts_demonstrate_the_exchange_a_rollout_produces_in_smollm2s_template(smollm2_dir, tmp_path):
    """examples/tool_prompts.py: the held-out rows are the multiply task's own, and the one
    demonstration in each prompt is tokenised as the rollout's own call and result would be, so
    the model is shown exactly the stream it is asked to produce."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from hflow.agents import AgentLimits, ToolEnvironment
    from hflow.data import task_splits

    tool_prompts = EXAMPLES.with_name("tool_prompts.py")
    subprocess.run([sys.executable, str(tool_prompts), "--out", str(tmp_path), "--eval-size", "8"], check=True)
    val = [json.loads(line) for line in open(tmp_path / "val.jsonl")]
    assert [r["answer"] for r in val] == [r["answer"] for r in task_splits("multiply", 0, 8)[1]]
    row = val[0]
    question = row["prompt"][-1]["content"]
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    env = ToolEnvironment(["calculator"], format="tags", reward_fn="gsm8k_flexible")
    turns = [f"<calc>{question.removesuffix('=')}</calc>", row["answer"]]
    t = run_episode(AgentSession(env, ChatRenderer(tok), row, AgentLimits()), Script(tok, turns))
    assert t.finish_reason == "done" and t.reward() == 1.0 and t.counts["tool_calls"] == 1
    # the rollout's stream is the template's rendering of the same exchange the demonstration shows
    conversation = row["prompt"] + [{"role": "assistant", "content": turns[0]}, {"role": "tool", "content": row["answer"]},
                                    {"role": "assistant", "content": turns[1]}]
    oracle = tok.encode(tok.apply_chat_template(conversation, tokenize=False), add_special_tokens=False)
    assert t.token_ids() == oracle[:len(t.token_ids())] and len(oracle) - len(t.token_ids()) <= 1   # its last "\n"
