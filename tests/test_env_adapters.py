"""The environment libraries' adapters (hflow.agents.adapters): TextArena's single-player games
(`--agent.env textarena:GAME`) and gymnasium's environments (`--agent.env gym:ENV`).

The oracle is the library itself: its environment made, reset with the same seed and driven
directly with the same actions gives the observations and rewards the adapter passes on. Then the
names through the registry (picklable factories, one-line errors), a session through hflow's
turn machinery, and recipes/agent.py training on a TextArena game on 2 ranks.
"""
import json
import pickle
import random
import re
import sys
import threading
from pathlib import Path

import pytest

from dist import torchrun
from hflow.agents import AgentLimits, AgentSession, TextRenderer, environment_factory, run_episode
from hflow.agents.adapters import row_seed

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "agent.py")


# ---- TextArena

def library_game(game: str, seed: int):
    """The game as TextArena makes it (its default wrappers: the whole history each turn), reset for one player."""
    ta = pytest.importorskip("textarena", reason="the textarena adapter's tests need textarena (pip install textarena)")
    env = ta.make(game)
    env.reset(num_players=1, seed=seed)
    return env


def test_textarena_guess_the_number_is_the_library_game_driven_directly():
    """Each observation is what the library's own LLMObservationWrapper adds to its history after
    the move ("[Player] <move>" then the game's lines); the reward is the library's at the end."""
    oracle = library_game("GuessTheNumber-v0", seed=3)
    _, history = oracle.get_observation()
    secret = oracle.game_number
    x, y, z = [n for n in range(1, 21) if n != secret][:3]
    # a repeat and a reply with no number are invalid moves (one in a row is allowed); "z" and the
    # last have no brackets: the game's ActionFormattingWrapper puts them in
    moves = [f"[{x}]", f"I guess [{y}]", f"[{x}]", str(z), "no number", str(secret)]

    env = environment_factory("textarena:GuessTheNumber-v0")()
    first = env.reset({"seed": 3, "prompt": "ignored", "answer": "ignored"})
    assert history == "\n" + first and first.startswith("[GAME] You are Player 0. You are playing Guess The Number")
    for i, move in enumerate(moves):
        result = env.step(move)
        done, _ = oracle.step(move)
        assert result.done == done, (i, move)
        if done:
            break
        _, history_now = oracle.get_observation()
        bracketed = move if "[" in move else f"[{move}]"   # the game's ActionFormattingWrapper, kept
        assert history_now == history + f"\n[Player] {bracketed}\n" + result.observation, (i, move)
        assert result.reward == 0.0
        history = history_now
    rewards, info = oracle.close()
    assert done and i == len(moves) - 1 and result.reward == rewards[0] == 1.0, (i, info)


def test_textarena_bandits_stepped_side_by_side_draw_what_each_draws_alone():
    """Bandit draws from Python's global random on every pull: two games on threads at once each
    see what the library alone gives for its seed, and the process's own random state is untouched."""
    pulls = ["[red]", "[blue]", "[green]", "[red]", "[yellow]", "[purple]"] * 3

    def alone(seed):
        game = library_game("Bandit-v0", seed)
        out = []
        for pull in pulls:
            done, _ = game.step(pull)
            out.append(game.get_observation()[1].rsplit("\n[Player] ", 1)[1])
        return out

    expected = {seed: alone(seed) for seed in (11, 12)}
    factory = environment_factory("textarena:Bandit-v0")
    got, start = {}, threading.Barrier(2)

    def play(seed):
        env = factory()
        env.reset({"seed": seed})
        start.wait()
        got[seed] = [f"{pull}\n{env.step(pull).observation}" for pull in pulls]

    random.seed(99)
    outside = random.random()
    random.seed(99)
    threads = [threading.Thread(target=play, args=(seed,)) for seed in expected]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert got == expected
    assert expected[11] != expected[12]
    assert random.random() == outside


def test_a_row_names_its_game_by_its_seed_column_or_its_prompt():
    pytest.importorskip("textarena", reason="needs textarena")
    factory = environment_factory("textarena:GuessTheNumber-v0")

    def secret(row):
        env = factory()
        env.reset(row)
        return env.env.game_number

    rows = [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in [(12, 34), (56, 78), (90, 12), (34, 56)]]
    assert [secret(r) for r in rows] == [secret(dict(r)) for r in rows]   # the same row, the same game
    assert len({row_seed(r) for r in rows}) == len(rows)
    assert secret({"seed": 5, "prompt": "x"}) == secret({"seed": 5, "prompt": "y"}) == library_game(
        "GuessTheNumber-v0", 5).game_number


@pytest.mark.parametrize("spec, expected", [
    ("textarena:GuessTheNumbr-v0", "textarena 0.7.4 has no game 'GuessTheNumbr-v0' (did you mean GuessTheNumber-v0"),
    ("textarena:TicTacToe-v0", "TicTacToe-v0 is a game for 2 players; hflow trains one policy against an environment"),
    ("textarena:Nim-v0", "Nim-v0 is a game for 2 players"),
    ("textarena:", "expected 'textarena:NAME'"),
    ("gym:CartPole-v9", "gymnasium cannot make CartPole-v9: VersionNotFound"),
    ("gym:Pendulum-v1", "Pendulum-v1 acts in Box("),
])
def test_a_bad_name_or_a_multi_player_game_is_refused_in_one_line(spec, expected):
    pytest.importorskip(spec.split(":")[0].replace("gym", "gymnasium") if spec.startswith("gym") else "textarena",
                        reason="needs the library")
    with pytest.raises(ValueError) as e:
        environment_factory(spec)
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert str(e.value).startswith(f"environment {spec!r}: ")


def test_a_missing_library_says_which_extra_installs_it(monkeypatch):
    from hflow.agents.adapters import textarena as adapter
    adapter.check_game.cache_clear()
    monkeypatch.setitem(sys.modules, "textarena", None)   # import textarena now raises ModuleNotFoundError
    with pytest.raises(ImportError, match=r"^environment 'textarena:GuessTheNumber-v0': the textarena package is "
                                          r"not installed \(pip install 'hflow\[textarena\]'"):
        environment_factory("textarena:GuessTheNumber-v0")
    monkeypatch.setitem(sys.modules, "gymnasium", None)
    with pytest.raises(ImportError, match=r"pip install 'hflow\[gymnasium\]'"):
        environment_factory("gym:FrozenLake-v1")


def test_the_factories_are_picklable_and_other_specs_are_not_taken():
    pytest.importorskip("textarena", reason="needs textarena")
    pytest.importorskip("gymnasium", reason="needs gymnasium")
    for spec in ("textarena:GuessTheNumber-v0", "gym:FrozenLake-v1", "gymnasium:FrozenLake-v1"):
        factory = pickle.loads(pickle.dumps(environment_factory(spec)))
        assert factory().reset({"seed": 1}) == environment_factory(spec)().reset({"seed": 1})
    with pytest.raises(ValueError, match="cannot import module 'textarena_not_a_prefix'"):
        environment_factory("textarena_not_a_prefix:Game")   # not a prefix: 'module:Class' as before


def test_a_textarena_game_through_an_agent_session(tiny_tokenizer):
    """hflow's session around the adapter: the stream is the game's prompt, the model's turns and
    the game's lines; the trajectory's reward is the library's."""
    oracle = library_game("GuessTheNumber-v0", seed=4)
    secret = oracle.game_number
    turns = iter([f"[{secret % 20 + 1}]", f"[{secret}]"])
    tok = tiny_tokenizer
    session = AgentSession(environment_factory("textarena:GuessTheNumber-v0")(), TextRenderer(tok), {"seed": 4},
                           AgentLimits(max_turns=4, max_response_tokens=400))

    def generate_with_logprobs(ids, max_new):
        ids = tok.encode(next(turns), add_special_tokens=False) + [tok.eos_token_id]
        return ids, [-1.0] * len(ids)

    t = run_episode(session, generate_with_logprobs)
    assert t.finish_reason == "done" and t.num_turns == 2 and t.turn_rewards == [0.0, 1.0], t
    text = tok.decode(t.token_ids(), skip_special_tokens=True)
    assert "You are playing Guess The Number" in text and "[GAME] The target number is" in text, text


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    from hflow.default.model import build_default
    return AutoTokenizer.from_pretrained(build_default(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0))


# ---- gymnasium

def test_gym_frozen_lake_is_the_library_env_driven_directly():
    """The text render (colour as brackets) and the observation, gymnasium's rewards and ends, for
    the same seed and actions (FrozenLake is slippery: the seed decides where a move goes); a
    reply with no valid action is told so and the environment does not step."""
    gym = pytest.importorskip("gymnasium", reason="the gymnasium adapter's tests need gymnasium (pip install gymnasium)")
    from hflow.agents.adapters.gymnasium import plain
    for seed in range(3):
        oracle = gym.make("FrozenLake-v1", render_mode="ansi")
        observation, _ = oracle.reset(seed=seed)
        env = environment_factory("gym:FrozenLake-v1")()
        first = env.reset({"seed": seed})
        assert first.startswith("FrozenLake-v1: reply with an action, an integer from 0 to 3.\n\n")
        assert first.endswith(f"{plain(oracle.render()).strip()}\nobservation: {observation}")
        assert "[S]FFF" in first and "\x1b" not in first
        invalid = env.step("go left, I think")
        assert invalid.info == {"invalid_actions": 1} and not invalid.done and "integer from 0 to 3" in invalid.observation
        rng, total = random.Random(seed), 0.0
        for _ in range(100):
            action = rng.randrange(4)
            result = env.step(f"I move {action}, then 3")   # the first integer is the action
            observation, reward, terminated, truncated, _ = oracle.step(action)
            assert (result.reward, result.done) == (reward, terminated or truncated)
            total += result.reward
            if result.done:
                break
            assert result.observation == f"{plain(oracle.render()).strip(chr(10))}\nobservation: {observation}"
        assert result.done


# ---- the recipe, on 2 ranks

@pytest.fixture(scope="module")
def guessing_model(tmp_path_factory):
    """The tiny embedded default (random weights) made to answer like a player who guesses: its LM
    head's rows of EOS and of the one-token numbers 1-9 pointed along its mean final hidden state
    (test_agent_rollout.ending_turns_model's trick), the numbers a little below EOS, so that a turn
    is mostly a number or nothing, then EOS: some guesses valid, some not, rewards that differ.
    Its context raised to 1024 tokens: TextArena's prompts (~300 tokens here) do not fit the
    default's 256 (RoPE, no position table: only the config's bound changes)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from hflow.default.model import build_default
    root = tmp_path_factory.mktemp("textarena_model")
    base, out = Path(build_default(root / "base", "tiny", seed=0)), root / "guessing"
    tok = AutoTokenizer.from_pretrained(base)
    numbers = [ids[0] for n in range(1, 10) if len(ids := tok.encode(str(n), add_special_tokens=False)) == 1]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        h = model.model(torch.randint(3, 500, (16, 40), generator=g)).last_hidden_state.reshape(-1, model.config.hidden_size)
        along = h.mean(0) / h.mean(0).norm() ** 2
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.lm_head.weight[tok.eos_token_id] = 12 * along
        model.lm_head.weight[numbers] = 10.5 * along
    model.config.max_position_embeddings = 1024
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.mark.dist
@pytest.mark.parametrize("env, library", [("textarena:GuessTheNumber-v0", "textarena"),
                                          ("gym:CliffWalking-v1", "gymnasium")], ids=["textarena", "gym"])
def test_agent_recipe_trains_on_a_library_environment(env, library, guessing_model, tmp_path):
    """recipes/agent.py --agent.env <a library's environment>: 2 ranks, 2 GRPO steps on its own
    reward (GuessTheNumber: a short reply is bracketed into a guess, its closeness the reward;
    CliffWalking: -1 a move, -100 off the cliff, a reply with no action 0), held-out episodes
    evaluated greedily before and after."""
    pytest.importorskip(library, reason=f"needs {library}")
    out = tmp_path / "run"
    torchrun(RECIPE, 2, [
        "--model.path", guessing_model, "--trainer.output-dir", out, "--trainer.steps", 2,
        "--data.batch-size", 4, "--rollout.n", 4, "--rollout.max-tokens", 384, "--agent.max-turn-tokens", 8,
        "--agent.max-turns", 4, "--agent.env", env, "--agent.reward", "env",
        # one micro-batch a rank: under --model.path's 1024-token budget a rank with fewer prompt groups than
        # the other's micro-batch count gets an empty one, which the forward cannot take (workers/micro_batches)
        "--actor.max-tokens-per-micro-batch", 8192,
        "--trainer.eval-size", 8, "--trainer.logging.no-progress-bars", "--trainer.no-export"], timeout=500).check()
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 1, 2]
    assert "eval/reward_mean" in logged[0] and "eval/reward_mean" in logged[-1]
    for row in logged[1:]:
        assert row["agent/turns"] >= 1 and row["agent/observation_tokens"] > 0, row
        assert row["actor/grad_norm"] > 0, row   # the episodes' rewards differ: something is learned
    print(f"{env} run:", json.dumps(logged))   # the figures, for the record (pytest -s)


@pytest.mark.dist
def test_agent_recipe_refuses_a_multi_player_game_before_anything_loads(tmp_path):
    pytest.importorskip("textarena", reason="needs textarena")
    run = torchrun(RECIPE, 2, ["--agent.env", "textarena:TicTacToe-v0", "--trainer.output-dir", tmp_path / "out"],
                   timeout=200)
    errors = [line for line in run.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--agent.env textarena:TicTacToe-v0: TicTacToe-v0 is a game for 2 players" in errors[0], \
        run.output
    assert re.search(r"exitcode\s*:\s*2\b", run.output), run.output


# ---- verifiers (an agent function over hflow's OpenAI-compatible endpoint)

DIGIT_TASKSET = '''
import verifiers.v1 as vf


class DigitData(vf.TaskData):
    digit: int


class DigitTask(vf.Task[DigitData]):
    @vf.reward(weight=1.0)
    async def closeness(self, trace: vf.Trace) -> float:
        """The reply's first digit against the task's: 1 when it is, 0 for no digit."""
        digit = next((c for c in trace.last_reply if c in "0123456789"), None)
        return 0.0 if digit is None else 1 - abs(int(digit) - self.data.digit) / 9


class DigitConfig(vf.TasksetConfig):
    num_tasks: int = 10


class DigitTaskset(vf.Taskset[DigitTask, DigitConfig]):
    def load(self):
        return [DigitTask(DigitData(prompt=f"Guess my digit ({i % 3} is not it). Reply with one digit.", digit=i),
                          self.config.task) for i in range(self.config.num_tasks)]


__all__ = ["DigitTaskset"]
'''


@pytest.fixture(scope="module")
def digit_taskset(tmp_path_factory):
    """A verifiers taskset of one-turn tasks (guess a digit, rewarded by closeness; no taskset
    verifiers ships runs offline: its textarena games download nltk corpora, the others need
    containers or remote services), installed as
    the module vf_digit on sys.path (PYTHONPATH for the ranks)."""
    pytest.importorskip("verifiers.v1", reason="the verifiers adapter's tests need verifiers >= 0.4")
    folder = tmp_path_factory.mktemp("vf_digit")
    (folder / "vf_digit.py").write_text(DIGIT_TASKSET)
    sys.path.insert(0, str(folder))
    yield str(folder)
    sys.path.remove(str(folder))


def test_a_whole_response_streamed_parses_back_to_itself_in_verifiers():
    """The endpoint's server-sent events for a streamed request (openai_format.stream_chunks),
    read by verifiers' own stream parser, give back the message and finish reason, tool calls
    included."""
    pytest.importorskip("verifiers.v1", reason="needs verifiers >= 0.4")
    from verifiers.v1.dialects.chat import ChatStreamParser
    from hflow.agents.endpoint.openai_format import chat_completion, stream_chunks
    message = {"role": "assistant", "content": "Let me add.", "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}
    completion = chat_completion("s", 0, message, "stop", [1, 2, 3, 4, 5], [7] * 7, [-0.5] * 7, ["x"] * 7)
    parser = ChatStreamParser()
    for chunk in stream_chunks(completion, include_usage=True):
        parser.feed(f"data: {json.dumps(chunk)}\n\n".encode())
    parser.feed(b"data: [DONE]\n\n")
    assert parser.finish_reason == "tool_calls" and parser.usage == completion["usage"]
    assert "".join(parser.message_parts["content"]) == "Let me add."
    call = parser.tool_calls[0]
    assert call["id"] == "call_0_0" and call["function"]["name"] == "add"
    assert "".join(parser.tool_inputs.get(0, [])) or call["function"]["arguments"] == "{\"a\": 1, \"b\": 2}"


def test_verifiers_agent_runs_an_episode_against_the_endpoint(digit_taskset, qwen3):
    """The agent function served by hflow's endpoint (a scripted engine answering "7" under
    Qwen3's template): verifiers' harness program asks, streaming, the endpoint answers with the
    whole turn, the task's own @reward scores the reply, and the trajectory is recorded."""
    from hflow.agents import AgentLimits
    from hflow.agents.endpoint.agent_function import is_agent_function
    from hflow.batch import Batch
    from hflow.workers.agent_rollout import sample_agent
    from hflow.workers.rollout_batches import RolloutConfig
    from test_agent_endpoint import ScriptedEngine
    agent = pickle.loads(pickle.dumps(environment_factory("verifiers:vf_digit")))
    assert is_agent_function(agent)
    llm = ScriptedEngine(qwen3, ["7", "7"], [qwen3.convert_tokens_to_ids("<|im_end|>")])
    batch = sample_agent(llm, Batch({"task": [3, 9], "prompt": ["ignored", "ignored"]}), "verifiers:vf_digit",
                         RolloutConfig(n=1, seed=0, progress=False), AgentLimits(step_timeout_s=300), qwen3, 0, None)
    print(batch["finish_reason"], batch["agent_error"])
    assert batch["trajectory_reward"].tolist() == pytest.approx([1 - 4 / 9, 1 - 2 / 9])
    assert batch["finish_reason"] == ["done", "done"] and batch["turns"].tolist() == [1, 1]
    asked = [qwen3.decode(p) for p in llm.prompts]
    assert all("Guess my digit (0 is not it). Reply with one digit." in p for p in asked)


def test_verifiers_names_are_checked_in_one_line(digit_taskset, monkeypatch):
    with pytest.raises(ValueError, match=r"^environment 'verifiers:no_such_taskset': no verifiers taskset"):
        environment_factory("verifiers:no_such_taskset")
    from hflow.agents.adapters import verifiers as adapter
    adapter.check_taskset.cache_clear()
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(ImportError, match=r"pip install 'hflow\[verifiers\]'"):
        environment_factory("verifiers:vf_digit")
    adapter.check_taskset.cache_clear()


@pytest.mark.dist
def test_agent_recipe_trains_on_a_verifiers_taskset_through_the_endpoint(digit_taskset, guessing_model, tmp_path):
    """recipes/agent.py --agent.env verifiers:vf_digit: each trajectory is one verifiers episode
    (its harness program in a subprocess, its requests through hflow's endpoint as the session's
    turns), scored by the taskset's own @reward; 2 ranks, 2 GRPO steps."""
    import os
    out = tmp_path / "run"
    torchrun(RECIPE, 2, [
        "--model.path", guessing_model, "--trainer.output-dir", out, "--trainer.steps", 2,
        "--data.batch-size", 2, "--rollout.n", 4, "--rollout.max-tokens", 64, "--agent.max-turn-tokens", 8,
        "--agent.env", "verifiers:vf_digit", "--agent.reward", "env",
        # a rank's first episode prepares verifiers' harness program (uv, once a machine) beside the others
        "--agent.step-timeout-s", 300,
        "--actor.max-tokens-per-micro-batch", 8192,
        "--trainer.eval-size", 4, "--trainer.logging.no-progress-bars", "--trainer.no-export"], timeout=590,
        env={"PYTHONPATH": os.pathsep.join([digit_taskset, os.environ.get("PYTHONPATH", "")])}).check()
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 1, 2]
    print("verifiers run:", json.dumps(logged))
    for row in logged[1:]:
        assert row["agent/turns"] == 1 and row["agent/failed"] == 0, row
        assert row["actor/grad_norm"] > 0, row   # the replies' rewards differ: something is learned
