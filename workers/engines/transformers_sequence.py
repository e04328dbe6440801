"""One sequence of the CPU engine's batch: what it was admitted with, what it produces each step, and
how each sampled token is taken (detokenised, checked against stop tokens, stop strings and the length
limits). Only the engine's torch thread touches a :class:`Seq`."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llamamesh.errors import LlamameshError
from llamamesh.types import FinishReason, GenerationRequest, TokenLogprob
from workers.engines.detokenizer import IncrementalDetokenizer, StopStrings
from workers.engines.sampling import ResolvedSampling, SequenceSampler


@dataclass(frozen=True)
class Admission:
    request: GenerationRequest
    params: ResolvedSampling
    # The constraint's xgrammar matcher when compiled already (else the batch compiles it).
    matcher: Any = None


@dataclass
class SeqOutput:
    """What one sequence produced in one step."""

    request_id: str
    prompt_tokens: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None


@dataclass
class StepResult:
    outputs: list[SeqOutput]
    # Requests that end with an error: refused before prefill (prompt too long, no input, ...), or
    # failed on their own (their prefill or their sample); the rest of the batch goes on.
    rejected: list[tuple[str, LlamameshError]]
    # Request ids still running after the step.
    running: list[str]
    # Real (unpadded) tokens held in the KV cache.
    cached_tokens: int
    # Sequences in this step's decode forward.
    decode_batch: int


class Seq:
    def __init__(
        self,
        admission: Admission,
        prompt_ids: list[int],
        sampler: SequenceSampler,
        tokenizer: Any,
        n_prompt: int,
        replay: Sequence[int] = (),
    ) -> None:
        self.request_id = admission.request.request_id
        self.params = admission.params
        # What precedes the output: the prompt, then any resumed tokens; n_prompt counts the prompt
        # alone. The prefill runs all but ``replay``, the resumed tokens fed through decode steps.
        self.prompt_ids = prompt_ids
        self.n_prompt = n_prompt
        self.prefill_ids = prompt_ids[: len(prompt_ids) - len(replay)]
        self.replay: deque[int] = deque(replay)
        self.sampler = sampler
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopStrings(admission.params.stop)
        self.stop_ids = frozenset(admission.params.stop_token_ids)
        self.generated = 0
        self.pending = -1
        self.finished: FinishReason | None = None
        # Set when this request failed on its own (its sample or its text); it leaves the batch.
        self.error: LlamameshError | None = None
        self.out: SeqOutput | None = None
        self.adapter = admission.request.adapter

    def accept(self, token: int, logprob: TokenLogprob | None, eos_ids: frozenset[int], max_model_len: int) -> bool:
        """Take a sampled token into this step's output (its text, logprobs, and the end it makes:
        a stop token or the end token, a stop string, or a length limit). True when it starts this
        step's output (the batch then collects it)."""
        out = self.out
        fresh = out is None
        if out is None:
            out = self.out = SeqOutput(self.request_id, self.n_prompt)
        self.sampler.observe(token)
        self.generated += 1
        out.token_ids.append(token)
        if logprob is not None:
            out.logprobs.append(logprob)
        n = self.generated
        reason: FinishReason | None = None
        if token in self.stop_ids or (token in eos_ids and not self.params.ignore_eos):
            # The stop token's own text is not part of the output.
            reason = FinishReason.STOP
            text = self.detok.flush()
        else:
            text = self.detok.push(token)
            if n >= self.params.max_tokens or len(self.prompt_ids) + n >= max_model_len:
                reason = FinishReason.LENGTH
                text += self.detok.flush()
        emit, stopped = self.stops.feed(text, check=n >= self.params.min_tokens)
        out.text += emit
        if stopped:
            reason = FinishReason.STOP_SEQUENCE
        elif reason is not None:
            out.text += self.stops.flush()
        if reason is None:
            self.pending = token
        else:
            self.finished = out.finish_reason = reason
        return fresh
