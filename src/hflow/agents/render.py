"""Observations into tokens without drift: the stream so far is never re-rendered.

A chat template renders a whole conversation, and re-rendering it after every turn is where
trajectories drift: the template may re-tokenise the model's text differently from how it was
sampled, or rewrite earlier turns (Qwen3 drops the `<think>` block of every assistant turn
before the last user message). So the stream only grows: the model's tokens as sampled, then
for each observation the tokens the template puts after an assistant turn's end-of-turn token,
found as the difference of two renders of a fixed reference conversation (never the real one),
`reference + observation + generation prompt` minus everything through the reference turn's
end. The difference is checked to tokenise on its own exactly as it does in place, so the
stream equals what the template would have tokenised, from the end-of-turn token on.

A model turn can be extended only if it ended with the end-of-turn token (the session checks).

An observation's content is text, never control tokens: a tool's output holding
`<|im_end|>\n<|im_start|>user` must not close its turn and forge a user's. So content is masked
where it holds a special token's text while the template renders (the template's own markers
are then the only specials in the render), and the render is tokenised split at those markers,
the text between them (masks undone) encoded with special-token parsing off.
"""
from __future__ import annotations

import functools
import re
from typing import Optional, Sequence, Union

Message = dict
Observation = Union[str, list[Message]]

TRUNCATION_MARKER = " [truncated]"
# A conversation whose assistant turn ends where a model turn would; its content is a word no
# template rewrites, so that its end can be found in any render.
_REFERENCE_ANSWER = "hflowreferenceanswer"
_REFERENCE = [{"role": "user", "content": "hflowreferencequestion"},
              {"role": "assistant", "content": _REFERENCE_ANSWER}]
_PROBE = "hflowprobe"
# Stands for the i-th special token's text inside content while a template renders it: private-use
# characters, which no tokenizer's special token and no template's own text holds.
_MASK = "\ue000hflow{}\ue001"
_MASKED = re.compile("\ue000hflow(\\d+)\ue001")


class TemplateError(ValueError):
    """The chat template cannot extend a token stream after a model turn exactly."""


class ObservationError(TypeError):
    """An environment's observation is not text or a list of messages with text content."""


def as_messages(observation: Observation) -> list[Message]:
    """Text is one user message; a list of messages is checked and copied."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if not isinstance(observation, (list, tuple)) or not observation:
        raise ObservationError(f"an observation is text or a non-empty list of messages, not {_show(observation)}")
    for m in observation:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ObservationError(f"a message is a dict with a 'role' and a text 'content', not {_show(m)}")
    return [dict(m) for m in observation]


def _show(value) -> str:
    return f"{type(value).__name__} {repr(value)[:60]}"


class Renderer:
    """What a session needs from a tokenizer: the prompt's ids, an observation's ids after a
    model turn, a turn's text, and content cut to a token budget."""

    def __init__(self, tokenizer, end_of_turn_id: int):
        self.tokenizer = tokenizer
        self.end_of_turn_id = end_of_turn_id
        for special in self._specials[:1]:
            if self.encode_text(special) == [tokenizer.convert_tokens_to_ids(special)]:
                raise TemplateError(f"the tokenizer encodes the text {special!r} as its special token even with "
                                    "split_special_tokens=True: a tool's output could forge control tokens")

    def prompt_ids(self, observation: Observation) -> list[int]:
        raise NotImplementedError

    def observation_ids(self, observation: Observation) -> list[int]:
        """The ids to append after a model turn that ended with `end_of_turn_id`, the next
        generation prompt included."""
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        """Text as a model writes it, its special-token text parsed (a tool-call tag may be a
        special token): for a model turn's ids, never an observation's (encode_text)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ---- content as text, the template's markers as special tokens

    @functools.cached_property
    def _specials(self) -> list[str]:
        """The text of the tokenizer's special tokens (those its encode turns into control ids),
        longest first, so that one holding another is matched whole."""
        decoder = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        return sorted({t.content for t in decoder.values() if t.special and t.content}, key=len, reverse=True)

    @functools.cached_property
    def _special_pattern(self) -> Optional[re.Pattern]:
        return re.compile("(" + "|".join(map(re.escape, self._specials)) + ")") if self._specials else None

    def mask(self, content: str) -> str:
        """Content with each special token's text masked, for a template (or a wrapper) to render."""
        if self._special_pattern is None:
            return content
        index = {text: i for i, text in enumerate(self._specials)}
        return self._special_pattern.sub(lambda m: _MASK.format(index[m[1]]), content)

    def _unmask(self, text: str) -> str:
        return _MASKED.sub(lambda m: self._specials[int(m[1])], text)

    def encode_text(self, text: str) -> list[int]:
        """Text as text: a special token's text in it is encoded as the characters it is made of."""
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def encode_rendered(self, rendered: str) -> list[int]:
        """A render of masked content: its special tokens (the template's) as control ids, the
        masked content as text, merged with the template's text around it as in place."""
        plain = list(self.tokenizer.encode(rendered, add_special_tokens=False))
        if _MASKED.search(rendered) is None:
            return plain   # no special-token text in the content: the tokenizer's own encoding is exact
        if self._split_encode(rendered, unmask=False) != plain:
            # e.g. a special token that strips the whitespace beside it: the split here would differ
            raise TemplateError("the tokenizer does not split this render at its special tokens as hflow does: "
                                "its content's special-token text cannot be kept as text")
        return self._split_encode(rendered, unmask=True)

    def _split_encode(self, rendered: str, unmask: bool) -> list[int]:
        # the tokenizer itself splits at special tokens first and encodes the text between them
        # on its own: so does this, with the masks undone only in that text
        ids = []
        pieces = self._special_pattern.split(rendered)
        for i, piece in enumerate(pieces):
            if i % 2:
                ids.append(self.tokenizer.convert_tokens_to_ids(piece))
            elif piece:
                ids.extend(self.encode_text(self._unmask(piece)) if unmask else
                           self.tokenizer.encode(piece, add_special_tokens=False))
        return ids

    def model_text(self, token_ids: Sequence[int]) -> str:
        """A turn as the environment reads it: special tokens kept (a tool-call tag may be one),
        the end-of-turn token dropped."""
        ids = list(token_ids)
        if ids and ids[-1] == self.end_of_turn_id:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def truncate(self, observation: Observation, max_tokens: int) -> tuple[Observation, int]:
        """Each message's content (or the text) cut to `max_tokens` tokens and marked; returns it
        and how many were cut."""
        if isinstance(observation, str):
            text, cut = self._truncate_text(observation, max_tokens)
            return text, int(cut)
        messages, cuts = [], 0
        for m in as_messages(observation):
            m["content"], cut = self._truncate_text(m["content"], max_tokens)
            messages.append(m)
            cuts += cut
        return messages, cuts

    def _truncate_text(self, text: str, max_tokens: int) -> tuple[str, bool]:
        ids = self.encode_text(text)
        if len(ids) <= max_tokens:
            return text, False
        # a cut inside a multi-byte character decodes to U+FFFD: leave the half character out
        kept = self.tokenizer.decode(ids[:max_tokens], skip_special_tokens=False).rstrip("\ufffd")
        return kept + TRUNCATION_MARKER, True


class ChatRenderer(Renderer):
    """Through the tokenizer's chat template, tools given to it as `tools=` (JSON schemas).
    `template_kwargs` go to every render (Qwen3: `enable_thinking=False`). The end-of-turn token
    is read off the template (the special token it puts right after an assistant's content)
    unless `end_of_turn` names it."""

    def __init__(self, tokenizer, tools: Optional[list[dict]] = None, template_kwargs: Optional[dict] = None,
                 end_of_turn: Optional[str] = None):
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise TemplateError("the tokenizer has no chat template: use TextRenderer")
        if tools and "tools" not in (template if isinstance(template, str) else str(template)):
            raise TemplateError("the chat template takes no tools=: describe the tools in the prompt yourself, "
                                "or use the tags tool-call format with TextRenderer")
        self.tools = list(tools) if tools else None
        self.template_kwargs = dict(template_kwargs or {})
        self.tokenizer = tokenizer
        self.end_of_turn = end_of_turn or self._find_end_of_turn(tokenizer)
        ids = list(tokenizer.encode(self.end_of_turn, add_special_tokens=False))
        if len(ids) != 1:
            raise TemplateError(f"the end-of-turn {self.end_of_turn!r} is {len(ids)} tokens, not one")
        super().__init__(tokenizer, ids[0])
        self._check_extends()

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        """The conversation rendered, its content masked (see encode_rendered)."""
        masked = [{**m, "content": self.mask(m["content"])} for m in messages]
        return self.tokenizer.apply_chat_template(masked, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.template_kwargs)

    def _find_end_of_turn(self, tokenizer) -> str:
        text = self._render(_REFERENCE, add_generation_prompt=False)
        after = text[text.rfind(_REFERENCE_ANSWER) + len(_REFERENCE_ANSWER):]
        for token in sorted(tokenizer.get_added_vocab(), key=len, reverse=True):
            if token and after.startswith(token):
                return token
        raise TemplateError(f"after an assistant's content the chat template renders {after[:30]!r}, not a "
                            "special token: a model turn's end cannot be told (pass end_of_turn=)")

    def _check_extends(self) -> None:
        probes = [[{"role": "user", "content": _PROBE}]]
        if self.tools:
            probes.append([{"role": "tool", "name": "probe", "content": _PROBE}])
        for probe in probes:
            text = self.tokenizer.decode(self.observation_ids(probe), skip_special_tokens=False)
            if _PROBE not in text:
                raise TemplateError(f"the chat template drops a {probe[0]['role']} message after an assistant turn "
                                    f"(it rendered {text!r})")

    def prompt_ids(self, observation: Observation) -> list[int]:
        return self.encode_rendered(self._render(as_messages(observation), add_generation_prompt=True))

    def observation_ids(self, observation: Observation) -> list[int]:
        full = self._render(_REFERENCE + as_messages(observation), add_generation_prompt=True)
        anchor = _REFERENCE_ANSWER + self.end_of_turn
        at = full.find(anchor)
        if at < 0 or full.find(anchor, at + 1) >= 0:
            raise TemplateError(f"the chat template does not end an assistant turn with {self.end_of_turn!r} right "
                                "after its content when messages follow it: a trajectory cannot be extended exactly")
        ids = self.encode_rendered(full[at + len(anchor):])
        in_place = self.encode_rendered(full)
        if in_place[len(in_place) - len(ids) - 1:] != [self.end_of_turn_id] + ids:
            raise TemplateError("the messages after an assistant turn tokenise differently on their own than in "
                                "the whole conversation: a trajectory cannot be extended exactly")
        return ids


class TextRenderer(Renderer):
    """For a tokenizer without a chat template (or a model that never saw one): the prompt is
    tokenised as it is, each observation on its own after the model's end token. A tool
    message is wrapped in `tool_result` (the tags format's `<result>...</result>`), any other
    message is its content."""

    def __init__(self, tokenizer, end_of_turn_id: Optional[int] = None,
                 tool_result: str = "<result>{content}</result>"):
        end_of_turn_id = tokenizer.eos_token_id if end_of_turn_id is None else end_of_turn_id
        if end_of_turn_id is None:
            raise TemplateError("the tokenizer has no eos token to end a model turn: pass end_of_turn_id=")
        if "{content}" not in tool_result:
            raise ValueError(f"tool_result {tool_result!r} has no {{content}} slot")
        super().__init__(tokenizer, end_of_turn_id)
        self.tool_result = tool_result

    def _text(self, observation: Observation, content=lambda text: text) -> str:
        """The observation as one text, each message's content passed through `content`."""
        if isinstance(observation, str):
            return content(observation)
        return "".join(self.tool_result.replace("{content}", content(m["content"])) if m["role"] == "tool"
                       else content(m["content"]) for m in as_messages(observation))

    def prompt_ids(self, observation: Observation) -> list[int]:
        # as hflow's data loading tokenises a text prompt: with the tokenizer's own specials (a BOS),
        # its special-token text parsed (the task's author wrote it; it may be a template's render)
        return list(self.tokenizer.encode(self._text(observation), add_special_tokens=True))

    def observation_ids(self, observation: Observation) -> list[int]:
        # content masked, so that only `tool_result`'s own special tokens (if any) stay special
        return self.encode_rendered(self._text(observation, content=self.mask))
