"""Output processing: each sampled token becomes what callers read.

Every sample has an incremental detokenizer; a token appended to a sample is checked against its
stop conditions (stop token ids, end of sequence, stop strings on the decoded text, max_tokens,
the context), its logprobs' candidates are decoded, and the step's StepOutput carries the new text.
A request of n samples is released as one RequestOutput once all n have finished; until then its
finished samples wait here.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.sequence import Sequence
from pagedserve.outputs import CompletionOutput, RequestOutput, SampleLogprobs, StepOutput

# (finish_reason, stop_reason): why a sample ended, and the stop token or string that ended it.
Finish = tuple[str, int | str | None]


@dataclass
class _Request:
    """A request's samples: its first sequence, then the forks made once the prompt is computed."""

    samples: list[Sequence]
    num_released: int = 0

    @property
    def num_samples(self) -> int:
        return self.samples[0].params.n


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._requests: dict[str, _Request] = {}
        self._detokenizers: dict[Sequence, IncrementalDetokenizer] = {}

    def add_request(self, seq: Sequence) -> None:
        self._requests[seq.request_id] = _Request([seq])
        self._add_detokenizer(seq)

    def add_forks(self, forks: dict[Sequence, list[Sequence]]) -> None:
        for parent, children in forks.items():
            self._requests[parent.request_id].samples += children
            for child in children:
                self._add_detokenizer(child)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def abort_request(self, request_id: str) -> list[Sequence] | None:
        """Forgets a request; returns its samples, or None if it was not here."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.samples:
            self._detokenizers.pop(seq, None)
        return request.samples

    def record_logprobs(self, seq: Sequence, logprobs: SampleLogprobs, output: StepOutput) -> None:
        self._decode_candidates([logprobs])
        seq.logprobs.append(logprobs)
        output.new_logprobs = [logprobs]

    def record_prompt_logprobs(self, seq: Sequence, entries: list[SampleLogprobs]) -> None:
        self._decode_candidates(entries)
        seq.prompt_logprobs.extend(entries)

    def _decode_candidates(self, entries: list[SampleLogprobs]) -> None:
        # Each candidate decoded alone, special tokens kept: a candidate has no text context, and
        # a client reading alternatives needs to see e.g. that the end-of-sequence was likely.
        tokens = [token for entry in entries for token in entry]
        texts = iter(self.tokenizer.batch_decode([[token] for token in tokens]))
        for entry in entries:
            for logprob in entry.values():
                logprob.decoded_token = next(texts)

    def process_token(self, seq: Sequence, token: int, output: StepOutput) -> Finish | None:
        """Decodes seq's newest token (already appended) into output's text; returns why seq
        has finished, or None while it goes on."""
        params = seq.params
        detokenizer = self._detokenizers[seq]
        reason: str | None = None
        stop_reason: int | str | None = None
        grammar_end = _advance_grammar(seq, token)
        if grammar_end == "error":
            reason = grammar_end
        elif token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos:
            reason = "stop"
        elif grammar_end is not None:
            reason = grammar_end
        else:
            piece = detokenizer.add_token(token, seq.num_output_tokens >= params.min_tokens)
            output.new_text = piece.text
            if piece.stop_string is not None:
                reason, stop_reason = "stop", piece.stop_string
        if reason is None and (
            seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is None:
            return None
        output.new_text += detokenizer.flush()
        output.finish_reason, output.stop_reason = reason, stop_reason
        return reason, stop_reason

    def release_sample(
        self, seq: Sequence, outputs: dict[tuple[str, int], StepOutput], now: float, step: int
    ) -> None:
        """Counts seq's result as released; once all the request's samples are, attaches the
        request's result to a piece that goes last among the request's pieces of this step."""
        request = self._requests.get(seq.request_id)
        if request is None:  # aborted after its release was decided
            return
        request.num_released += 1
        if request.num_released < request.num_samples:
            return
        key = (seq.request_id, seq.sample_index)
        output = outputs.pop(key, None) or StepOutput(seq.request_id, index=seq.sample_index)
        output.final = self._release(request, now, step)
        outputs[key] = output

    def _add_detokenizer(self, seq: Sequence) -> None:
        self._detokenizers[seq] = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, seq.params.stop, seq.params.skip_special_tokens
        )

    def _release(self, request: _Request, now: float, step: int) -> RequestOutput:
        first = request.samples[0]
        first.metrics.finished_time = now
        first.metrics.finished_step = step
        self._requests.pop(first.request_id)
        completions = [
            CompletionOutput(
                index=seq.sample_index,
                text=self._detokenizers.pop(seq).text,
                token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=seq.logprobs,
            )
            for seq in sorted(request.samples, key=lambda s: s.sample_index)
        ]
        return RequestOutput(
            request_id=first.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=True,
            metrics=first.metrics,
            prompt_logprobs=first.prompt_logprobs,
        )


def _advance_grammar(seq: Sequence, token: int) -> str | None:
    """Feeds the token to the sample's matcher; why the sample ends there, if it does: "stop" once
    the grammar has accepted a stop token (ignore_eos or not), "error" when the grammar refuses
    the token (drawn from a row where nothing was allowed: the grammar's mask and min_tokens' bans
    together excluded every token)."""
    if seq.grammar is None:
        return None
    if not seq.grammar.accept_token(token):
        return "error"
    return "stop" if seq.grammar.is_terminated() else None
