"""examples/agent_envs.py, the README's environment and tool, played through real sessions."""
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
