"""Incremental detokenization with the real SmolLM2 tokenizer: what streams adds up exactly."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagedserve.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, this is   a test with  double spaces.",
    "Café, naïve, Zürich: accents; 東京 and 北京 in CJK; emoji 🎉🚀 and 👩‍👩‍👧 family.",
    "Line one\nLine two\n\n\tindented\r\nend",
    " leading space and trailing space ",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def _stream(tokenizer, token_ids: list[int], stop: list[str]) -> tuple[list[str], str | None]:
    detokenizer = IncrementalDetokenizer(tokenizer, [1, 2, 3], stop, skip_special=True)
    pieces, found = [], None
    for token in token_ids:
        piece = detokenizer.add_token(token, check_stop=True)
        pieces.append(piece.text)
        if piece.stop_string is not None:
            found = piece.stop_string
            break
    pieces.append(detokenizer.flush())
    return pieces, found


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_the_text_without_broken_characters(tokenizer, text):
    token_ids = tokenizer(text, add_special_tokens=False).input_ids
    pieces, _ = _stream(tokenizer, token_ids, [])
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_stop_string_spanning_tokens_is_cut_and_never_emitted(tokenizer):
    text = TEXTS[1]
    token_ids = tokenizer(text, add_special_tokens=False).input_ids
    pieces, found = _stream(tokenizer, token_ids, ["北京", "never"])
    assert found == "北京"
    assert "".join(pieces) == text[: text.index("北京")]
