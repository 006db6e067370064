# Copyright 2026 The path-hf authors. Apache-2.0.
"""Cache layers of a PaTH attention layer.

Importing this module registers them for the layer type `"path_attention"`: `DynamicCache(config)` (what `generate`
builds by default) gives every PaTH layer of a `PaTHLlamaConfig` a `PaTHCacheLayer`, and `StaticCache(config,
max_cache_len)` (`generate(cache_implementation="static")`) a `PaTHStaticCacheLayer`.
"""

import torch
from transformers.cache_utils import DynamicLayer, StaticLayer
from transformers.utils import is_torchdynamo_compiling

from .configuration_path_llama import PATH_LAYER_TYPE
from .ops import path_decode_update


def _refuse_crop(tokens_to_remove: int) -> None:
    if tokens_to_remove != 0:
        raise ValueError(
            "A PaTH cache cannot be cropped: the keys hold the Householder transforms of the tokens to remove."
        )


class PaTHCacheLayer(DynamicLayer):
    """What a PaTH layer needs to continue a sequence.

    Attributes:
        keys: `[B, H, S, D]` cached keys, fully transformed up to the last cached token e:
            `H_e ... H_{j+1} k_j`. Each new token applies its own Householder transform to all of them before its key
            is appended, so decoding attends to them like to a plain KV cache.
        values: `[B, H, S, DV]`.
        conv_state: `[B, K - 1, kv_dim]` the last K - 1 inputs of the short convolution on w (zeros at padding),
            or None (no convolution, or nothing cached yet).
        gate: `[B, HQ, S]` float32, PaTH-FoX only: `G_e - G_j`, the log forget gate accumulated from each cached
            token j to the last one. Stored relative to the last token, so it stays small on long sequences.
    """

    _layer_type = PATH_LAYER_TYPE
    # The Householder transforms already applied to the keys cannot be undone.
    is_croppable = False

    # The least room a decode step's buffer grows by (`_with_room`).
    GROWTH_TOKENS = 256

    def __init__(self, **kwargs):
        super().__init__()
        self.conv_state: torch.Tensor | None = None
        self.gate: torch.Tensor | None = None
        self._room: dict[str, torch.Tensor] = {}  # the buffers `keys` and `values` are views of, by name

    def decode_update(
        self, w: torch.Tensor, beta: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step: the new token's Householder transform (`w` `[B, H, D]`, `beta` `[B, H]`) applied to every
        cached key, then its key and value `[B, H, 1, D]` appended (as `update`); returns the keys and values.

        The keys and values are views of buffers with room to grow (`_with_room`): the transform updates the keys in
        place and the new token is written after them, so a step copies nothing, where `DynamicLayer.update`'s
        `torch.cat` copies the whole cache at every token."""
        cached = self.keys.shape[-2]
        keys, moved = self._with_room("keys", self.keys)
        path_decode_update(self.keys, w, beta, out=keys[:, :, :cached])  # in place, or into a new buffer
        values, moved = self._with_room("values", self.values)
        if moved:
            values[:, :, :cached] = self.values
        keys[:, :, cached : cached + 1] = key_states
        values[:, :, cached : cached + 1] = value_states
        self.keys, self.values = keys[:, :, : cached + 1], values[:, :, : cached + 1]
        return self.keys, self.values

    def _with_room(self, name: str, cached: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The buffer `[B, H, capacity, D]` that holds `cached` `[B, H, S, D]` in its first S slots with room for one
        more token, and whether it is new (then `cached` must still be written into it). `cached` is a view of the
        buffer when the last decode step left it so, and anything that replaced it since (a prefill's `update`,
        `reorder_cache`, a move to another device) makes a new one, a quarter larger than `cached` (at least
        `GROWTH_TOKENS` slots more), so its copy is paid once every S / 4 steps rather than at every step."""
        buffer = self._room.get(name)
        length = cached.shape[-2]
        if (
            buffer is not None
            and buffer.data_ptr() == cached.data_ptr()
            and buffer.stride() == cached.stride()
            and buffer.shape[:2] == cached.shape[:2]
            and buffer.dtype == cached.dtype
            and buffer.device == cached.device
            and buffer.shape[-2] > length
        ):
            return buffer, False
        capacity = length + max(self.GROWTH_TOKENS, length // 4)
        self._room[name] = buffer = cached.new_empty(*cached.shape[:2], capacity, cached.shape[-1])
        return buffer, True

    def replace_keys(self, keys: torch.Tensor) -> None:
        """Set the transformed keys `[B, H, S, D]` of all S cached tokens (a chunked prefill recomputes them)."""
        self.keys = keys

    def get_key_mask(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Which cached keys a new token may attend, `[B, S]` bool, from the padding mask `[B, S]` of the tokens seen
        so far (None: all of them)."""
        return attention_mask

    def update_conv_state(self, inputs: torch.Tensor, state_size: int) -> torch.Tensor | None:
        """Store the last `state_size` convolution inputs after `inputs` `[B, T, C]`; return the previous state."""
        previous = self.conv_state
        history = inputs if previous is None else torch.cat([previous, inputs], dim=1)
        if history.shape[1] < state_size:
            history = torch.nn.functional.pad(history, (0, 0, state_size - history.shape[1], 0))
        self.conv_state = history[:, history.shape[1] - state_size :]
        return previous

    def update_gate(self, g: torch.Tensor) -> torch.Tensor:
        """Account for new tokens' log forget gates `g` `[B, T, HQ]`; return the gate `[B, HQ, S + T]`."""
        g_cum = g.float().transpose(1, 2).cumsum(-1)
        total = g_cum[..., -1:]
        new = total - g_cum
        self.gate = new if self.gate is None else torch.cat([self.gate + total, new], dim=-1)
        return self.gate

    def reset(self) -> None:
        super().reset()
        self.conv_state = self.gate = None
        self._room.clear()

    def crop(self, tokens_to_remove: int) -> None:
        _refuse_crop(tokens_to_remove)

    def _map_states(self, fn) -> None:
        if self.conv_state is not None:
            self.conv_state = fn(self.conv_state)
        if self.gate is not None:
            self.gate = fn(self.gate)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_states(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_states(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_states(lambda x: x[indices, ...])


class PaTHStaticCacheLayer(StaticLayer):
    """`PaTHCacheLayer` in buffers of fixed size, updated in place: what `torch.compile` needs for decoding.

    Holds the same states as `PaTHCacheLayer`, in `max_cache_len` slots of which the first `cumulative_length` are
    used; a new token's transform runs over all slots and the attention masks the unused ones, so a decode step has
    the same shapes at every length.

    Attributes:
        keys: `[B, H, max_cache_len, D]` transformed keys (`PaTHCacheLayer.keys`), values `[B, H, max_cache_len, DV]`.
        conv_state: `[B, K - 1, kv_dim]`, zeros until the first tokens (allocated by the first `update_conv_state`).
        gate: `[B, HQ, max_cache_len]` float32, `G_e - G_j` over the used slots (allocated by the first
            `update_gate`).
    """

    _layer_type = PATH_LAYER_TYPE
    # The Householder transforms already applied to the keys cannot be undone.
    is_croppable = False

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__(max_cache_len)
        self.conv_state: torch.Tensor | None = None
        self.gate: torch.Tensor | None = None

    def _new_buffer(self, *shape: int, like: torch.Tensor) -> torch.Tensor:
        buffer = torch.zeros(shape, dtype=like.dtype, device=like.device)
        if not is_torchdynamo_compiling():  # as StaticLayer's keys: a fixed address for compiled graphs
            torch._dynamo.mark_static_address(buffer)
        return buffer

    def decode_update(
        self, w: torch.Tensor, beta: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step: the new token's Householder transform applied to every slot in place, then its key and
        value stored (`update`); returns the slots' keys and values."""
        path_decode_update(self.keys, w, beta, out=self.keys)
        return self.update(key_states, value_states)

    def replace_keys(self, keys: torch.Tensor) -> None:
        """Set the transformed keys `[B, H, S, D]` of the S cached tokens (a chunked prefill recomputes them)."""
        self.keys[:, :, : keys.shape[2]] = keys

    def get_key_mask(self, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Which slots a new token may attend, `[B or 1, max_cache_len]` bool: the used ones, less padding (the
        padding mask `[B, S]` of the tokens seen so far, or None)."""
        mask = (torch.arange(self.max_cache_len, device=self.device) < self.cumulative_length)[None]
        if attention_mask is not None:
            mask = mask & torch.nn.functional.pad(attention_mask, (0, self.max_cache_len - attention_mask.shape[1]))
        return mask

    def update_conv_state(self, inputs: torch.Tensor, state_size: int) -> torch.Tensor:
        """Store the last `state_size` convolution inputs after `inputs` `[B, T, C]`; return the previous state."""
        if self.conv_state is None:
            self.conv_state = self._new_buffer(inputs.shape[0], state_size, inputs.shape[2], like=inputs)
        history = torch.cat([self.conv_state, inputs], dim=1)
        self.conv_state.copy_(history[:, history.shape[1] - state_size :])
        return history[:, :state_size]

    def update_gate(self, g: torch.Tensor) -> torch.Tensor:
        """Account for the log forget gates `g` `[B, T, HQ]` of the last T tokens `update` stored; return the gate
        `[B, HQ, max_cache_len]`."""
        g_cum = g.float().transpose(1, 2).cumsum(-1)
        total = g_cum[..., -1:]
        if self.gate is None:
            self.gate = self._new_buffer(*g_cum.shape[:2], self.max_cache_len, like=g_cum)
        positions = self.cumulative_length - g.shape[1] + torch.arange(g.shape[1], device=g.device)
        self.gate.add_(total).index_copy_(-1, positions, total - g_cum)
        return self.gate

    def reset(self) -> None:
        super().reset()
        for state in (self.conv_state, self.gate):
            if state is not None:
                state.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        _refuse_crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for state in (self.keys, self.values, self.conv_state, self.gate):
            if state is not None:
                state.copy_(state.index_select(0, beam_idx.to(state.device)))


__all__ = ["PaTHCacheLayer", "PaTHStaticCacheLayer"]
