"""The running batch of the CPU engine (:class:`Batch`): every sequence in flight, advanced one token
per step. Each :meth:`Batch.step` drops aborted sequences, prefills the admitted ones (one by one,
unpadded, into a fresh transformers cache that then joins the batch's
:class:`~workers.engines.transformers_kv.RaggedKV` along the batch dim), runs one decode step for
every running sequence (``input_ids [B, 1]``, explicit position ids and a 4-D mask), samples per
sequence, and drops the finished sequences from the cache.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import structlog
import torch
from transformers import DynamicCache

from llamamesh.errors import InternalError, InvalidRequest, LlamameshError, NotFound
from llamamesh.types import FinishReason, GenerationRequest, TokenLogprob
from workers.engines.adapter import check_prompt_tokens
from workers.engines.constraints import Grammars, GrammarsFor
from workers.engines.prompts import render_prompt_ids
from workers.engines.sampling import SequenceSampler, sample_batch, token_logprobs
from workers.engines.transformers_kv import RaggedKV, check_supported, use_aligned_attention
from workers.engines.transformers_linear import use_row_groups
from workers.engines.transformers_lora import PeftAdapters
from workers.engines.transformers_sequence import Admission, Seq, SeqOutput, StepResult

# Admission is also imported from here by the benchmarks (bench/row_groups.py).
__all__ = ["Admission", "Batch"]

log = structlog.get_logger(__name__)


class Batch:
    """The sequences in flight and their KV cache; not thread-safe (only the engine's torch thread
    touches it).

    Batch invariance: a sequence decodes to the same bits alone or batched, in bfloat16 too, because
    every decode-step matrix product has one fixed shape (transformers_linear.py) and decode attention
    reads each row's keys at fixed offsets in 64-aligned views (transformers_kv.py). Greedy text then
    does not depend on the other requests (the tests assert it, also with oneDNN and ATen capped at
    other x86 instruction sets)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_model_len: int,
        row_groups: bool = True,
        replay_max: int = 0,
        grammars: GrammarsFor = Grammars,
    ) -> None:
        """ValueError if the model's attention or cache cannot be batched this way. ``row_groups``:
        decode GEMMs in fixed-shape groups (batch invariance, at a cost for small batches);
        ``replay_max``: resumed tokens replayed through decode steps at most (more are prefilled);
        ``grammars``: what compiles response_format constraints for the tokenizer."""
        check_supported(model.config)
        use_aligned_attention(model)
        if row_groups:
            use_row_groups(model)
        # transformers 5.24 renamed the forward's past_key_values to cache (the old name is deprecated).
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._replay_max = replay_max
        self.model = model
        self.tokenizer = tokenizer
        config = model.config
        self.max_model_len = min(max_model_len, getattr(config, "max_position_embeddings", max_model_len))
        self.vocab_size: int = config.vocab_size
        eos: set[int] = set()
        for source in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
            if isinstance(source, int):
                eos.add(source)
            elif source is not None:
                eos.update(source)
        self.eos_ids = frozenset(eos)
        self.grammars = grammars(tokenizer, self.vocab_size, self.eos_ids)
        self._seqs: list[Seq] = []
        self._kv: RaggedKV | None = None
        # [B]: tokens in the cache per row, which is also the position of each pending token.
        self._lengths = torch.zeros(0, dtype=torch.long)
        self._touched: list[Seq] = []
        self._peft = PeftAdapters(model)

    # --- LoRA adapters

    @property
    def adapters(self) -> set[str]:
        return self._peft.names

    def load_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter folder ``path`` as ``name`` (between steps, on the torch thread).
        NotFound if it is not there; InvalidRequest if peft cannot load it for this model."""
        self._peft.load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Drop adapter ``name`` (its running requests must have ended: the engine checks)."""
        self._peft.unload(name)

    def _forward(self, seqs: list[Seq], **kwargs: Any) -> Any:
        return self._peft.forward([s.adapter for s in seqs], **kwargs)

    @property
    def running(self) -> int:
        return len(self._seqs)

    @property
    def cached_tokens(self) -> int:
        return int(self._lengths.sum())

    # --- input

    def encode(self, request: GenerationRequest) -> list[int]:
        """Token ids for the request's prompt (as is) or messages (chat template); InvalidRequest if
        neither (the GPU adapters' rendering: the same request gives the same ids on every engine)."""
        return render_prompt_ids(request, self.tokenizer, self.max_model_len)

    def _admit(self, admission: Admission) -> Seq:
        """A sequence for ``admission``. A resumed request (mid-stream failover) replays the tokens an
        earlier attempt sent through decode steps, as the uninterrupted run computed them, so the
        continuation is the same bits too (a seeded sample included: its generator draws for the
        replayed tokens as well); past ``WorkerSettings.resume_replay_tokens`` they are prefilled with
        the prompt instead (one pass: fast, but prefill and decode kernels round differently, so
        greedy text may part at a near-tie)."""
        request = admission.request
        if request.adapter and request.adapter not in self.adapters:
            raise NotFound(f"adapter {request.adapter!r} is not loaded on this worker")
        ids = self.encode(request)
        n_prompt = len(ids)
        input_field = "messages" if request.messages is not None else "prompt"
        if not ids:
            raise InvalidRequest.field(input_field, "the prompt has no tokens")
        resumed = list(request.resume_token_ids)  # what an earlier attempt generated and the caller has
        if any(not 0 <= t < self.vocab_size for t in resumed):
            raise InvalidRequest.field("resume_token_ids", f"token ids must be in [0, {self.vocab_size})")
        ids += resumed
        check_prompt_tokens(len(ids), self.max_model_len, input_field, "max_model_len")
        replay = resumed if 0 < len(resumed) <= self._replay_max else []
        matcher = None
        if admission.params.constraint is not None:
            matcher = admission.matcher or self.grammars.matcher(admission.params.constraint)
            # A resumed request: the grammar continues from what the earlier attempt generated.
            if not all(matcher.accept_token(t) for t in resumed):
                raise InvalidRequest.field("resume_token_ids", "they do not follow the response_format")
        sampler = SequenceSampler(
            admission.params, self.vocab_size, ids[: len(ids) - len(replay)], self.eos_ids, matcher
        )
        seq = Seq(admission, ids, sampler, self.tokenizer, n_prompt, replay)
        sent = seq.detok.seed(resumed)
        if resumed and not admission.params.min_tokens:  # its earlier run checked stop strings
            seq.stops.prime(sent)
        return seq

    # --- the step

    def step(self, admit: Sequence[Admission], aborts: frozenset[str] | set[str]) -> StepResult:
        """Drop ``aborts``, prefill ``admit``, decode one token for every sequence. What one request
        causes (a prompt the tokenizer or template rejects, a prefill that fails, a sample that cannot
        be drawn) ends that request alone with an error (``StepResult.rejected``); only a failing
        decode forward of the whole batch is the engine's own failure (raised)."""
        with torch.inference_mode():
            return self._step(admit, aborts)

    def _step(self, admit: Sequence[Admission], aborts: frozenset[str] | set[str]) -> StepResult:
        self._touched = []
        outputs: list[SeqOutput] = []
        if aborts:
            keep = []
            for i, seq in enumerate(self._seqs):
                if seq.request_id in aborts:
                    out = SeqOutput(seq.request_id, seq.n_prompt, finish_reason=FinishReason.CANCELLED)
                    outputs.append(out)
                else:
                    keep.append(i)
            self._select(keep)
        rejected: list[tuple[str, LlamameshError]] = []
        joining: list[tuple[Seq, RaggedKV]] = []
        for admission in admit:
            rid = admission.request.request_id
            try:
                seq = self._admit(admission)
                kv = self._prefill(seq)
            except LlamameshError as exc:
                rejected.append((rid, exc))
                self._touched = [s for s in self._touched if s.request_id != rid]
                continue
            except Exception:  # this request's input or prefill: it fails alone
                log.exception("engine_request_failed", request_id=rid, stage="prefill")
                rejected.append((rid, InternalError("the engine could not start this request")))
                self._touched = [s for s in self._touched if s.request_id != rid]
                continue
            if seq.finished is None:
                joining.append((seq, kv))
        if joining:
            self._join(joining)
        decode_batch = len(self._seqs)
        if self._seqs:
            self._decode()
        rejected += self._drop_failed()
        outputs += [s.out for s in self._touched if s.out is not None]
        for seq in self._touched:
            seq.out = None
        self._touched = []
        return StepResult(
            outputs=outputs,
            rejected=rejected,
            running=[s.request_id for s in self._seqs],
            cached_tokens=self.cached_tokens,
            decode_batch=decode_batch,
        )

    def _prefill(self, seq: Seq) -> RaggedKV:
        """Run the prompt alone (no padding: the same numbers as ``model.generate``); sample its first token.
        Raises what the sample raised (the request fails alone)."""
        n = len(seq.prefill_ids)
        cache = DynamicCache(config=self.model.config)
        out = self._forward(
            [seq],
            input_ids=torch.tensor([seq.prefill_ids], dtype=torch.long),
            attention_mask=torch.ones((1, n), dtype=torch.long),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        self._sample([seq], out.logits[:, -1, :].float())
        if seq.error is not None:
            raise seq.error
        return RaggedKV.from_prefill(cache, n)

    def _join(self, joining: list[tuple[Seq, RaggedKV]]) -> None:
        parts = ([self._kv] if self._kv is not None else []) + [kv for _, kv in joining]
        self._kv = parts[0] if len(parts) == 1 else RaggedKV.concat(parts)
        lengths = torch.tensor([len(s.prefill_ids) for s, _ in joining], dtype=torch.long)
        self._lengths = torch.cat([self._lengths, lengths])
        self._seqs = self._seqs + [s for s, _ in joining]

    def _decode(self) -> None:
        assert self._kv is not None
        seqs = self._seqs
        mask = self._kv.prepare_decode(self._lengths)
        out = self._forward(
            seqs,
            input_ids=torch.tensor([[s.pending] for s in seqs], dtype=torch.long),
            attention_mask=mask,
            position_ids=self._lengths[:, None],
            use_cache=True,
            **{self._cache_kwarg: self._kv},
        )
        self._lengths = self._lengths + 1
        self._sample(seqs, out.logits[:, -1, :].float())

    def _drop_failed(self) -> list[tuple[str, LlamameshError]]:
        """Remove the finished and the failed sequences from the batch; the failed ones' errors."""
        failed = [(s.request_id, s.error) for s in self._seqs if s.error is not None]
        if failed or any(s.finished is not None for s in self._seqs):
            self._select([i for i, s in enumerate(self._seqs) if s.finished is None and s.error is None])
        self._touched = [s for s in self._touched if s.error is None]
        return failed  # type: ignore[return-value]

    def _select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` of the batch."""
        if len(keep) == len(self._seqs):
            return
        if not keep:
            self._seqs, self._kv = [], None
            self._lengths = torch.zeros(0, dtype=torch.long)
            return
        assert self._kv is not None
        rows = torch.tensor(keep, dtype=torch.long)
        self._lengths = self._lengths.index_select(0, rows)
        self._kv.select(rows, int(self._lengths.max()))
        self._seqs = [self._seqs[i] for i in keep]

    # --- sampling and stopping

    def _sample(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        """One token for each of ``seqs``; a sequence whose sample or text fails gets ``error`` set
        (and leaves the batch with it) while the others go on."""
        try:
            tokens: list[int | None] = list(sample_batch(logits, [s.sampler for s in seqs]))
        except Exception:  # find the row at fault: each alone
            tokens = [self._sample_one(seq, logits[i : i + 1]) for i, seq in enumerate(seqs)]
        rows = [
            i for i, s in enumerate(seqs) if s.params.logprobs is not None and not s.replay and tokens[i] is not None
        ]
        logprobs: dict[int, TokenLogprob] = {}
        if rows:
            top = [seqs[i].params.logprobs or 0 for i in rows]
            picked = token_logprobs(logits, rows, [tokens[i] or 0 for i in rows], top)
            logprobs = dict(zip(rows, picked, strict=True))
        for i, seq in enumerate(seqs):
            token = tokens[i]
            if token is None:
                continue
            if seq.replay:  # a resumed token: it takes the sampled one's place, unseen by the caller
                token = seq.replay.popleft()
                seq.sampler.observe(token, generated=False)
                seq.pending = token
                continue
            try:
                self._accept(seq, token, logprobs.get(i))
            except Exception:
                log.exception("engine_request_failed", request_id=seq.request_id, stage="output")
                seq.error = InternalError("the engine could not produce this request's next token")

    @staticmethod
    def _sample_one(seq: Seq, logits: torch.Tensor) -> int | None:
        try:
            return sample_batch(logits, [seq.sampler])[0]
        except Exception:
            log.exception("engine_request_failed", request_id=seq.request_id, stage="sample")
            seq.error = InternalError("the engine could not sample this request's next token")
            return None

    def _accept(self, seq: Seq, token: int, logprob: TokenLogprob | None) -> None:
        if seq.accept(token, logprob, self.eos_ids, self.max_model_len):
            self._touched.append(seq)
