"""What reading chat content as text costs: one long conversation tokenized through the chat
template with control tokens in content kept as text (the default) and parsed (transformers'
apply_chat_template as is), best of several rounds taken in turns."""

from __future__ import annotations

import time

from pagedserve.bench.records import ChatTokenizing
from pagedserve.engine.chat_content import ChatTokenizer

_WORDS = [
    "the",
    "paged",
    "cache",
    "holds",
    "every",
    "request's",
    "keys",
    "and",
    "values",
    "in",
    "blocks",
    "of",
    "sixteen",
    "tokens",
]


def conversation(tokenizer, messages: int, tokens: int, spell: str = "") -> list[dict]:
    """messages turns, user and assistant by turns, of about tokens ids in all; each message
    ends with spell (a control token's text, or nothing)."""
    per_word = len(tokenizer.encode(" ".join(_WORDS), add_special_tokens=False)) / len(_WORDS)
    per_message = max(1, int(tokens / messages / per_word))
    text = " ".join(_WORDS[i % len(_WORDS)] for i in range(per_message))
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": f"{i}: {text}{spell}"} for i in range(messages)]


def measure_chat_tokenizing(
    tokenizer, messages: int = 20, tokens: int = 4096, rounds: int = 20
) -> ChatTokenizing:
    plain = conversation(tokenizer, messages, tokens)
    spell = next(iter(tokenizer.get_added_vocab()))
    forged = conversation(tokenizer, messages, tokens, spell)
    text, parse = ChatTokenizer(tokenizer, "text"), ChatTokenizer(tokenizer, "parse")
    cases = {"parse": (parse, plain), "text": (text, plain), "text, forged": (text, forged)}
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for name, (chat, turns) in cases.items():
            started = time.perf_counter()
            chat.token_ids(turns, True, None)
            best[name] = min(best[name], time.perf_counter() - started)
    return ChatTokenizing(
        messages=messages,
        tokens=len(parse.token_ids(plain, True, None)),
        parse_ms=1000 * best["parse"],
        text_ms=1000 * best["text"],
        forged_text_ms=1000 * best["text, forged"],
    )
