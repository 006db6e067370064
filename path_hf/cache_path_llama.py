# Copyright 2026 The path-hf authors. Apache-2.0.
"""Cache layer of a PaTH attention layer.

Importing this module registers `PaTHCacheLayer` for the layer type `"path_attention"`, so `DynamicCache(config)`
(which is what `generate` builds) gives every PaTH layer of a `PaTHLlamaConfig` one of these.
"""

import torch
from transformers.cache_utils import DynamicLayer

from .configuration_path_llama import PATH_LAYER_TYPE


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

    def __init__(self, **kwargs):
        super().__init__()
        self.conv_state: torch.Tensor | None = None
        self.gate: torch.Tensor | None = None

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

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise ValueError(
                "A PaTH cache cannot be cropped: the keys hold the Householder transforms of the tokens to remove."
            )

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


__all__ = ["PaTHCacheLayer"]
