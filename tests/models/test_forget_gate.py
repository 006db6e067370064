"""The forget gate at model level, against a reference written from its definition: with the Householder transforms
at the identity (`path_init="identity"`) and RoPE dropped, a PaTH layer's attention weight of key j for query i is
`exp(q_i . k_j / sqrt(d)) * prod_{t=j+1..i} f_t ** (gain / sqrt(d))`, normalised, with `f_t = sigmoid(g_proj(x_t))`
the forget gate (a number in (0, 1): older keys fade). The log gate joins the logits before the 1 / sqrt(d) scale, as
in FLA's PaTH attention (`fla.ops.path_attn.naive`: `((A + G_i - G_j) * scale).softmax`). A sign or an offset of the
gate wrong in the model or its ops moves the output away from this reference; the direction is checked too (a gate
that forgets more must weigh recent keys more)."""

import math

import torch

from tests.models.tiny_models import tiny_model


def reference_attention(attention, hidden_states: torch.Tensor) -> torch.Tensor:
    """The layer's output from its own projections and the definition above, in float64, by brute force."""
    q, k, v = (t.double() for t in attention.project_qkv(hidden_states, None))  # [B, T, H, D]
    heads, kv_heads, head_dim = q.shape[2], k.shape[2], q.shape[3]
    k, v = (t.repeat_interleave(heads // kv_heads, dim=2) for t in (k, v))
    forget = torch.sigmoid(attention.g_proj(hidden_states).double())  # [B, T, H], in (0, 1)
    gain = attention.g_gain(torch.ones(heads)).double()  # the per-head gain on the log gate
    assert bool((gain > 0).all()), "the gate must be on for the reference to see it"
    batch, length = q.shape[:2]
    out = torch.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            for i in range(length):
                weights = torch.zeros(i + 1, dtype=torch.float64)
                for j in range(i + 1):
                    exponent = float(gain[h]) / math.sqrt(head_dim)
                    kept = math.prod(float(forget[b, t, h]) ** exponent for t in range(j + 1, i + 1))
                    weights[j] = math.exp(float(q[b, i, h] @ k[b, j, h]) / math.sqrt(head_dim)) * kept
                out[b, i, h] = (weights / weights.sum()) @ v[b, : i + 1, h]
    return attention.o_proj(out.reshape(batch, length, -1).to(hidden_states.dtype))


def test_the_forget_gate_is_the_definitions_at_model_level():
    model = tiny_model(path_init="identity", rope_mode="drop", path_conv_size=0).double()
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        torch.nn.init.normal_(attention.g_proj.bias, -1.0, 0.5)  # a gate that forgets visibly within 10 tokens
        attention.g_gain.weight.copy_(torch.linspace(0.5, 1.0, model.config.num_attention_heads))  # gate on
        hidden_states = torch.randn(2, 10, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        hidden_states = hidden_states.double()
        got = attention(hidden_states, position_embeddings=None)[0]
        torch.testing.assert_close(
            got, reference_attention(attention, hidden_states), rtol=1e-6, atol=1e-6
        )  # g in float32

        # The direction: more forgetting moves the output of the last query towards the last key's value.
        v_last = attention.o_proj(attention.project_qkv(hidden_states, None)[2][:, -1:].repeat_interleave(
            model.config.num_attention_heads // model.config.num_key_value_heads, dim=2).flatten(2))  # fmt: skip
        before = (got[:, -1] - v_last[:, 0]).norm()
        attention.g_proj.bias.sub_(6.0)
        after = (attention(hidden_states, position_embeddings=None)[0][:, -1] - v_last[:, 0]).norm()
        assert after < 0.5 * before
