"""The KV cache of the CPU engine's running batch (:class:`RaggedKV`), and the decode attention that
reads it (:func:`use_aligned_attention`), laid out so that a sequence's attention gives the same
bits alone or batched. Only the engine's torch thread touches these objects.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ALIGN = 64
# Extra positions reserved when a buffer grows, so that it grows every few hundred tokens only.
HEADROOM = 192
ATTENTION = "llamamesh_sdpa"


def round_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def check_supported(config: Any) -> None:
    """ValueError unless every layer of the model keeps a plain full-attention ``DynamicLayer`` cache."""
    layers = DynamicCache(config=config).layers
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise ValueError(f"the engine batches full-attention caches only, this model uses {kinds}")


class _Cursor:
    """Where the next decode step writes (per row) and how much of the buffers attention sees."""

    def __init__(self, batch: int) -> None:
        self.reset(batch)

    def reset(self, batch: int) -> None:
        self.rows = torch.arange(batch)
        self.write_at = torch.zeros(batch, dtype=torch.long)
        self.view_len = 0


class _RaggedLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, cursor: _Cursor) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.cursor = cursor
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise NotImplementedError("a ragged layer is built from a prefilled cache")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        if key_states.shape[-2] != 1:
            raise ValueError("the ragged cache takes one token per sequence per step")
        c = self.cursor
        self.keys[c.rows, :, c.write_at] = key_states[:, :, 0]
        self.values[c.rows, :, c.write_at] = value_states[:, :, 0]
        return self.keys[:, :, : c.view_len], self.values[:, :, : c.view_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cursor.view_len, 0

    def get_seq_length(self) -> int:
        return self.cursor.view_len

    def get_max_length(self) -> int:
        return -1


class RaggedKV(Cache):
    """Right-padded per-row KV buffers for every layer: per layer, ``keys`` and ``values`` as
    ``[batch, kv_heads, capacity, head_dim]`` buffers in which row ``i`` holds its sequence's tokens at
    positions ``0 .. len_i - 1`` (unlike transformers' left-padded batches). A decode step writes each
    row's new token at its own position, in place, and attention sees the first ``view_len``
    positions (a multiple of :data:`ALIGN`) with the rest of each row masked out. Nothing is
    concatenated per step.

    Why right padding and aligned views: a sequence's keys then sit at the same offsets whatever else
    is in the batch, and with views a multiple of 64 long, the padding only adds whole masked blocks,
    so SDPA returns the same bits for a sequence alone or batched, in bfloat16 too."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.cursor = _Cursor(keys[0].shape[0])
        self.ragged = [_RaggedLayer(k, v, self.cursor) for k, v in zip(keys, values, strict=True)]
        super().__init__(layers=list(self.ragged))

    @property
    def batch(self) -> int:
        return int(self.cursor.rows.shape[0])

    @property
    def capacity(self) -> int:
        keys = self.ragged[0].keys
        assert keys is not None
        return int(keys.shape[2])

    def _buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        keys = [layer.keys for layer in self.ragged]
        values = [layer.values for layer in self.ragged]
        assert all(k is not None for k in keys) and all(v is not None for v in values)
        return keys, values  # type: ignore[return-value]

    @classmethod
    def from_prefill(cls, cache: DynamicCache, length: int) -> RaggedKV:
        """Take over a one-sequence transformers cache holding ``length`` tokens."""
        capacity = round_up(length + 1) + HEADROOM
        keys, values = [], []
        for layer in cache.layers:
            if type(layer) is not DynamicLayer or layer.keys is None or layer.values is None:
                raise ValueError("the engine batches full-attention DynamicLayer caches only")
            keys.append(F.pad(layer.keys, (0, 0, 0, capacity - layer.keys.shape[2])))
            values.append(F.pad(layer.values, (0, 0, 0, capacity - layer.values.shape[2])))
        return cls(keys, values)

    @classmethod
    def concat(cls, parts: list[RaggedKV]) -> RaggedKV:
        """One cache holding the rows of ``parts``, in order (copies every buffer)."""
        capacity = max(p.capacity for p in parts)
        buffers = [p._buffers() for p in parts]
        keys, values = [], []
        for i in range(len(parts[0].ragged)):
            keys.append(torch.cat([F.pad(b[0][i], (0, 0, 0, capacity - b[0][i].shape[2])) for b in buffers]))
            values.append(torch.cat([F.pad(b[1][i], (0, 0, 0, capacity - b[1][i].shape[2])) for b in buffers]))
        return cls(keys, values)

    def select(self, rows: torch.Tensor, longest: int) -> None:
        """Keep only ``rows``; shrink the buffers when the longest remaining row is far shorter."""
        capacity = min(self.capacity, round_up(longest + 1) + HEADROOM)
        for layer in self.ragged:
            assert layer.keys is not None and layer.values is not None
            layer.keys = layer.keys.index_select(0, rows)[:, :, :capacity].contiguous()
            layer.values = layer.values.index_select(0, rows)[:, :, :capacity].contiguous()
        self.cursor.reset(int(rows.shape[0]))

    def prepare_decode(self, lengths: torch.Tensor) -> torch.Tensor:
        """Set up a decode step for rows of ``lengths`` tokens; return its 4-D boolean attention mask."""
        longest = int(lengths.max())
        view = round_up(longest + 1)
        if view > self.capacity:
            grow = view + HEADROOM - self.capacity
            for layer in self.ragged:
                assert layer.keys is not None and layer.values is not None
                layer.keys = F.pad(layer.keys, (0, 0, 0, grow))
                layer.values = F.pad(layer.values, (0, 0, 0, grow))
        self.cursor.write_at = lengths
        self.cursor.view_len = view
        return (torch.arange(view)[None, :] <= lengths[:, None])[:, None, None, :]


def _aligned_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except for one-token queries: those run on keys padded to a
    multiple of :data:`ALIGN` under a boolean mask, with GQA inside the kernel (the path the
    engine's ragged cache takes), so a sequence decodes to the same bits alone, batched, or in
    ``model.generate``."""
    simple = kwargs.get("softcap") is None and kwargs.get("position_bias") is None and dropout == 0.0
    if query.shape[2] != 1 or not simple or (attention_mask is not None and attention_mask.dtype != torch.bool):
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    length = key.shape[2]
    pad = round_up(length) - length
    if attention_mask is None:
        attention_mask = torch.ones((1, 1, 1, length), dtype=torch.bool, device=query.device)
    if pad:
        key = F.pad(key, (0, 0, 0, pad))
        value = F.pad(value, (0, 0, 0, pad))
        attention_mask = F.pad(attention_mask, (0, pad), value=False)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


def use_aligned_attention(model: Any) -> None:
    """Switch a model on stock SDPA attention to :func:`_aligned_attention` (prefill is unchanged).
    transformers' own decode (``model.generate``) then takes the same path, so the engine and
    ``generate`` agree."""
    if model.config._attn_implementation != "sdpa":
        raise ValueError(f"the engine needs SDPA attention, not {model.config._attn_implementation!r}")
    AttentionInterface.register(ATTENTION, _aligned_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
