"""A request's prompt as token ids: the work bounded before it starts, and chat content kept as text.

- Length first: a prompt with more characters than the context could hold at twice the vocabulary's longest
  token (the slack covers normalisers) is refused before it is tokenized. A 20 MB prompt otherwise costs a
  minute of tokenizer time and gigabytes of its memory only to be refused for its tokens afterwards.
- Chat: message content is text, never special tokens. "</s><s><|im_start|>system" typed into a message must
  not end the turn and open a system turn (llama.cpp tokenizes user text with ``parse_special=false``). Where
  no content holds the text of a special token, the template's own tokenization is used unchanged; where some
  does, the template is rendered with a marker in place of each content, its own text is tokenized with special
  tokens parsed and each content with special-token parsing off.
- Completions: the prompt is text in the same way, unless the server parses special tokens in prompts
  (``--parse-special-tokens``: a client that writes a whole chat prompt itself; token-id prompts are taken as
  they are either way).

The server calls this in a worker thread (tokenizing and rendering never hold its event loop); the Generator's
chat_ids uses it too.
"""

from __future__ import annotations

import copy
import re
import secrets

from ..errors import CapacityError


class PromptEncoder:
    """``tokenizer``: the model's; ``capacity``: the context, in tokens; ``parse_special``: completions prompts
    may spell special tokens."""

    def __init__(self, tokenizer, capacity: int, parse_special: bool = False):
        self.tokenizer = tokenizer
        # a copy whose special-token parsing is off for good: transformers switches it per call on the shared
        # Rust tokenizer, which would race between the worker threads
        self.text_tokenizer = copy.deepcopy(tokenizer)
        self.text_tokenizer.split_special_tokens = True
        self.capacity = capacity
        self.parse_special = parse_special
        self.chars_per_token = 2 * max((len(t) for t in tokenizer.get_vocab()), default=1)
        specials = sorted({t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special},
                          key=len, reverse=True)
        self._special = re.compile("|".join(map(re.escape, specials))) if specials else None

    def check_length(self, chars: int, what: str = "the prompt") -> None:
        """CapacityError before tokenizing text that cannot fit the context whatever its tokens."""
        most = self.capacity * self.chars_per_token
        if chars > most:
            raise CapacityError(f"{what} has {chars} characters, more than this server's {self.capacity}-token context "
                                f"can hold (at most {most}: {self.chars_per_token} a token); shorten it")

    def completion(self, prompt) -> list:
        """A completions prompt's ids (a string is tokenized; token ids pass through for the scheduler to check)."""
        if not isinstance(prompt, str):
            return prompt
        self.check_length(len(prompt))
        tokenizer = self.tokenizer if self.parse_special else self.text_tokenizer
        return tokenizer(prompt)["input_ids"]

    def chat(self, messages: list[dict]) -> list[int]:
        """The chat template's prompt for ``messages`` (OpenAI's dicts), content tokenized as text."""
        texts = [t for m in messages for t in _texts(m.get("content"))]
        self.check_length(sum(map(len, texts)), "the messages' content")
        found = None
        if self._special is not None:
            found = next((m.group() for m in map(self._special.search, texts) if m), None)
        if found is None:
            return _ids(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        return self._chat_as_text(messages, found)

    def _chat_as_text(self, messages, found: str) -> list[int]:
        # the template rendered with a marker for each content: its own pieces keep their special tokens, the
        # contents go through the text tokenizer
        tag = secrets.token_hex(8)
        contents: list[str] = []

        def marker(text):
            contents.append(text)
            return f"\ue000{tag}{len(contents) - 1}\ue001"  # private-use characters: no tokenizer special

        marked = [{**m, "content": _map_texts(m.get("content"), marker)} for m in messages]
        rendered = self.tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
        pieces = re.split(f"\ue000{tag}(\\d+)\ue001", rendered)
        real = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if real != "".join(contents[int(p)] if i % 2 else p for i, p in enumerate(pieces)):
            raise ValueError(f"a message holds the text of the special token {found!r}, and this model's chat template "
                             "changes message content (it does not pass it through as it is), so it cannot be kept "
                             "as plain text; remove it")
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids += self.text_tokenizer(contents[int(piece)], add_special_tokens=False)["input_ids"]
            elif piece:
                ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        return ids


def _texts(content) -> list[str]:
    """The text in a message's content: a string, or the "text" of its parts (OpenAI's content parts)."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def _map_texts(content, f):
    if isinstance(content, str):
        return f(content)
    if isinstance(content, list):
        return [{**p, "text": f(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
                for p in content]
    return content


def _ids(rendered) -> list[int]:
    return list(rendered["input_ids"] if isinstance(rendered, dict) else rendered)
