"""Chat content stays content: a conversation's strings are tokenized as text.

A chat template renders a conversation to one string and the tokenizer turns it into ids. Were
that string tokenized whole, a message spelling one of the tokenizer's special or added tokens
("<|im_end|>", "<think>") would get that control token, and its author could close their own turn
and open a system turn of theirs. In "text" mode (the default) every string the conversation
carries (content, text parts, names, tool-call arguments, tool results, the tools' definitions)
is tokenized as text, and only the template's own markers become control tokens:

- A conversation spelling no control token is rendered and tokenized as transformers'
  `apply_chat_template(..., tokenize=True)` does it: the ids are exactly those.
- Otherwise each spelling is replaced, before rendering, by one character of Unicode's
  Supplementary Private Use Area-A standing in for it. The rendered text is tokenized piece by
  piece between stand-ins, and each stand-in's text through the tokenizer's normalizer,
  pre-tokenizer and model alone, which know nothing of added tokens. Template text around a
  spelling keeps its ids; the subwords at the edges of a spelling may differ from those a
  whole-string tokenization would merge there. A template that edits content where it spells
  a control token (Qwen3's cuts reasoning at "</think>") finds none and keeps the content whole.
  Characters of that area typed in content are treated as spellings, so none of them is taken
  for a stand-in.

"parse" mode tokenizes the rendered string whole, control tokens in content included.
"""

from __future__ import annotations

import re
from typing import Any

from jinja2 import TemplateError

from pagedserve.validation import FieldError

_FIRST_STAND_IN = 0xF0000  # U+F0000..U+FFFFD: Supplementary Private Use Area-A
_STAND_INS = "\U000f0000-\U000ffffd"
# More distinct spellings than a conversation can hold in practice; the stand-ins never run out.
MAX_SPELLINGS = 4096


class ChatTokenizer:
    def __init__(self, tokenizer, mode: str = "text"):  # mode: config.CHAT_CONTENT_MODES
        self.tokenizer = tokenizer
        self.mode = mode
        controls = sorted((text for text in tokenizer.get_added_vocab() if text), key=len)
        alternatives = [re.escape(text) for text in reversed(controls)]  # longest first
        self._spelling = re.compile("|".join([*alternatives, f"[{_STAND_INS}]"]))
        self._stand_in = re.compile(f"[{_STAND_INS}]")

    def token_ids(
        self, conversation: list[dict], add_generation_prompt: bool, tools: list[dict] | None
    ) -> list[int]:
        """The conversation through the chat template as ids; ValueError when the template
        refuses it."""
        spellings: dict[str, str] = {}
        if self.mode == "text":
            conversation = self._stand_ins(conversation, spellings)
            tools = self._stand_ins(tools, spellings)
        try:
            rendered = self.tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=not spellings,
                return_dict=False,
            )
        except TemplateError as error:
            raise ValueError(f"the model's chat template refused the messages: {error}") from None
        if not spellings:
            return list(rendered)
        texts = list(spellings)
        ids, at = [], 0
        for match in self._stand_in.finditer(rendered):
            ids += self._encode(rendered[at : match.start()])
            ids += self._as_text(texts[ord(match.group()) - _FIRST_STAND_IN])
            at = match.end()
        return ids + self._encode(rendered[at:])

    def _stand_ins(self, value: Any, spellings: dict[str, str]) -> Any:
        """value with every control spelling in its strings replaced by its stand-in."""
        if isinstance(value, str):
            if self._spelling.search(value) is None:
                return value
            return self._spelling.sub(lambda match: self._stand_in_for(match, spellings), value)
        if isinstance(value, dict):
            return {
                self._stand_ins(key, spellings): self._stand_ins(item, spellings)
                for key, item in value.items()
            }
        if isinstance(value, list | tuple):
            return [self._stand_ins(item, spellings) for item in value]
        return value

    @staticmethod
    def _stand_in_for(match: re.Match, spellings: dict[str, str]) -> str:
        text = match.group()
        if text not in spellings:
            if len(spellings) == MAX_SPELLINGS:
                raise FieldError(
                    "messages",
                    f"messages spell more than {MAX_SPELLINGS} distinct control tokens or "
                    "private-use characters",
                )
            spellings[text] = chr(_FIRST_STAND_IN + len(spellings))
        return spellings[text]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def _as_text(self, text: str) -> list[int]:
        """text's ids as plain text: the added-token table is never consulted."""
        backend = self.tokenizer.backend_tokenizer
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        pieces = [(text, None)]
        if backend.pre_tokenizer is not None:
            pieces = backend.pre_tokenizer.pre_tokenize_str(text)
        return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]
