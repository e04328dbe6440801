"""vLLM's outputs as ours: a ``RequestOutput`` (DELTA kind) as one TokenDelta per sample, its finish
reason, and where a finished request's time went. Pure: testable without vLLM.

Fields read: ``RequestOutput.finished``, ``prompt_token_ids``, ``outputs`` (``CompletionOutput``
``.index`` / ``.text`` / ``.token_ids`` / ``.logprobs`` as ``{token_id: Logprob(logprob, rank, ...)}`` per
token / ``.finish_reason`` / ``.stop_reason``) and ``metrics`` (a ``RequestStateStats``)."""

from __future__ import annotations

import time
from typing import Any

from llamamesh.types import FinishReason, TokenDelta
from workers.engines import adapter
from workers.engines.adapter import token_logprobs


def finish_reason_of(reason: str | None, stop_reason: int | str | None) -> FinishReason | None:
    """vLLM's finish_reason/stop_reason as ours (adapter.finish_reason_of): "abort" is CANCELLED,
    "repetition" (only with repetition_detection, which we never set) STOP; "error" (a request-level
    engine failure) raises InternalError."""
    return adapter.finish_reason_of(reason, stop_reason, engine="vLLM", cancelled="abort", also_stop=("repetition",))


def delta_of(output: Any, n_logprobs: int | None) -> TokenDelta:
    """One vLLM RequestOutput (DELTA kind, one completion) as a TokenDelta; the final one carries
    prompt_tokens = len(prompt_token_ids)."""
    if not output.outputs:
        return TokenDelta()
    return _completion_delta(output, output.outputs[0], n_logprobs)


def deltas_of(output: Any, n_logprobs: int | None) -> list[TokenDelta]:
    """Every completion of one vLLM RequestOutput (DELTA kind) as a TokenDelta of its sample
    (``CompletionOutput.index``: with n > 1, an output holds the samples that moved since the last)."""
    return [_completion_delta(output, c, n_logprobs) for c in output.outputs]


def _completion_delta(output: Any, completion: Any, n_logprobs: int | None) -> TokenDelta:
    reason = finish_reason_of(completion.finish_reason, completion.stop_reason)
    ids = tuple(completion.token_ids)
    return TokenDelta(
        text=completion.text,
        token_ids=ids,
        logprobs=token_logprobs(ids, completion.logprobs, n_logprobs),
        finish_reason=reason,
        prompt_tokens=len(output.prompt_token_ids or ()) if reason is not None else None,
        # vLLM's prefix-cache hits of the prompt (RequestOutput.num_cached_tokens), on the last one
        cached_tokens=getattr(output, "num_cached_tokens", None) if reason is not None else None,
        sample=getattr(completion, "index", 0) or 0,
    )


def engine_timings(output: Any, tokenize_ms: float, now: float | None = None) -> tuple[tuple[str, float], ...]:
    """Where a finished request's time went: our tokenisation, then vLLM's own view
    (``RequestOutput.metrics``, a ``RequestStateStats`` when stats are on): arrival in vLLM → first
    token, waiting in the scheduler's queue, prefill (first scheduled → first token), decode (first →
    last token), and delivery: from the engine core's last token to ``now`` (``time.monotonic()``,
    when this frontend handed over the final output; one clock for every process of the host)."""
    out = [("tokenize", round(tokenize_ms, 2))]
    m = getattr(output, "metrics", None)
    if m is not None and getattr(m, "first_token_ts", None):
        out.append(("vllm_ttft", round(m.first_token_latency * 1e3, 2)))
        if getattr(m, "queued_ts", None) and getattr(m, "scheduled_ts", None):  # 0: the engine core's stats off
            out += [
                ("vllm_queue", round((m.scheduled_ts - m.queued_ts) * 1e3, 2)),
                ("vllm_prefill", round((m.first_token_ts - m.scheduled_ts) * 1e3, 2)),
            ]
        if getattr(m, "last_token_ts", None):
            now = time.monotonic() if now is None else now
            out += [
                ("vllm_decode", round((m.last_token_ts - m.first_token_ts) * 1e3, 2)),
                ("vllm_delivery", round((now - m.last_token_ts) * 1e3, 2)),
            ]
    return tuple(out)
