import shutil

import pytest
import torch
from transformers import CompileConfig, DynamicCache, LlamaConfig, StaticCache

from path_hf import PaTHCacheLayer, PaTHStaticCacheLayer
from path_hf.ops import path_decode_update
from tests.models.tiny_models import TINY, random_tokens, tiny_model

VARIANTS = {
    "fox-conv3": {},
    "noconv-nofox": {"path_forget_gate": False, "path_conv_size": 0},
    "mixed-conv4-lowrank": {"path_layers": [1], "path_conv_size": 4, "path_w_rank": 4},
    "drop-rope": {"rope_mode": "drop"},
    "interleave-rope": {"rope_mode": "interleave"},
    # critical-band RoPE (two of four pairs turn) and the log-length temperature, past its length from position 5
    "interleave-band-temperature": {
        "rope_mode": "interleave",
        "rope_max_wavelength": 100,
        "path_attn_temperature_scale": 0.5,
        "path_attn_temperature_length": 6,
    },
}


def left_padded_batch(lengths=(9, 6, 8), seed=0):
    T = max(lengths)
    ids = random_tokens(len(lengths), T, seed=seed)
    mask = (torch.arange(T) >= T - torch.tensor(lengths)[:, None]).long()
    return ids, mask  # real tokens under the padding: it must be ignored, not merely embed to zero


@pytest.mark.parametrize("num_beams", [1, 3], ids=["greedy", "beam3"])
@pytest.mark.parametrize("fields", list(VARIANTS.values()), ids=list(VARIANTS))
def test_cached_generation_equals_recompute(fields, num_beams):
    """generate() with the PaTH cache (decode-step key updates, conv and gate states, beam reordering) equals
    generate() recomputing the whole forward at every step."""
    model = tiny_model(**{"rope_mode": "keep", **fields})
    ids, mask = left_padded_batch()
    kwargs = dict(
        attention_mask=mask, max_new_tokens=7, do_sample=False, num_beams=num_beams, return_dict_in_generate=True
    )
    cached = model.generate(ids, use_cache=True, output_logits=True, **kwargs)
    path_layers = [layer_type == "path_attention" for layer_type in model.config.layer_types]
    assert [isinstance(layer, PaTHCacheLayer) for layer in cached.cache.layers] == path_layers
    recomputed = model.generate(ids, use_cache=False, output_logits=True, **kwargs)
    torch.testing.assert_close(cached.sequences, recomputed.sequences, rtol=0, atol=0)
    for step_cached, step_recomputed in zip(cached.logits, recomputed.logits, strict=True):
        torch.testing.assert_close(step_cached, step_recomputed, rtol=1e-4, atol=1e-4)
    if num_beams > 1:
        torch.testing.assert_close(cached.sequences_scores, recomputed.sequences_scores)


@pytest.mark.parametrize("num_beams", [1, 3], ids=["greedy", "beam3"])
@pytest.mark.parametrize("fields", list(VARIANTS.values()), ids=list(VARIANTS))
def test_static_cache_generation_equals_dynamic(fields, num_beams):
    """generate(cache_implementation="static") (fixed buffers, masked unused slots) makes the tokens and logits of
    the dynamic cache, with left padding; so does a user-built StaticCache with room to spare."""
    model = tiny_model(**{"rope_mode": "keep", **fields})
    ids, mask = left_padded_batch()
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=7,
        do_sample=False,
        num_beams=num_beams,
        return_dict_in_generate=True,
        output_logits=True,
    )
    dynamic = model.generate(ids, **kwargs)
    static = model.generate(ids, cache_implementation="static", **kwargs)
    user = model.generate(ids, cache=StaticCache(config=model.config, max_cache_len=32), **kwargs)
    path_layers = [layer_type == "path_attention" for layer_type in model.config.layer_types]
    for out in (static, user):
        assert [isinstance(layer, PaTHStaticCacheLayer) for layer in out.cache.layers] == path_layers
        torch.testing.assert_close(out.sequences, dynamic.sequences, rtol=0, atol=0)
        for step_static, step_dynamic in zip(out.logits, dynamic.logits, strict=True):
            torch.testing.assert_close(step_static, step_dynamic, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inside inductor
@pytest.mark.skipif(shutil.which("cc") is None, reason="torch.compile on CPU needs a C compiler")
def test_compiled_static_decode_equals_eager():
    """The decode step with a static cache compiles as one graph (fullgraph: no graph break) on CPU, and the compiled
    generate makes the eager tokens and logits."""
    model = tiny_model(rope_mode="keep", num_hidden_layers=1)
    ids, mask = left_padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    eager = model.generate(ids, output_logits=True, **kwargs)
    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True  # generate compiles only on accelerators unless told
    torch._dynamo.reset()
    try:
        compiled = model.generate(
            ids, cache_implementation="static", compile_config=compile_config, output_logits=True, **kwargs
        )
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled.sequences, eager.sequences, rtol=0, atol=0)
    for step_compiled, step_eager in zip(compiled.logits, eager.logits, strict=True):
        torch.testing.assert_close(step_compiled, step_eager, rtol=1e-4, atol=1e-4)


def forward_in_pieces(model, ids, mask, cuts, cache=None):
    """Logits of `ids` fed as the pieces between `cuts`, each continuing the same cache."""
    cache = DynamicCache(config=model.config) if cache is None else cache
    logits = []
    for start, end in zip(cuts[:-1], cuts[1:], strict=True):
        logits.append(model(ids[:, start:end], attention_mask=mask[:, :end], cache=cache, use_cache=True).logits)
    return torch.cat(logits, dim=1), cache


@pytest.mark.parametrize("fields", list(VARIANTS.values()), ids=list(VARIANTS))
def test_chunked_prefill_and_decode_equal_one_forward(fields):
    model = tiny_model(**{"rope_mode": "keep", **fields})
    ids, mask = left_padded_batch(lengths=(12, 7, 10))
    valid = mask.bool()
    expected = model(ids, attention_mask=mask).logits[valid]

    single, single_cache = forward_in_pieces(model, ids, mask, [0, 12])
    chunked, chunked_cache = forward_in_pieces(model, ids, mask, [0, 4, 9, 10, 12])
    decoded, _ = forward_in_pieces(model, ids, mask, [0, 3, *range(4, 13)])
    for logits in (single, chunked, decoded):
        torch.testing.assert_close(logits[valid], expected, rtol=1e-4, atol=1e-5)
    # A chunked prefill leaves the cache a single prefill leaves (transformed keys, values, conv and gate states).
    for a, b in zip(single_cache.layers, chunked_cache.layers, strict=True):
        for name in ("keys", "values", "conv_state", "gate"):
            if getattr(a, name, None) is not None:
                torch.testing.assert_close(getattr(b, name), getattr(a, name))


@pytest.mark.parametrize("fields", list(VARIANTS.values()), ids=list(VARIANTS))
def test_static_cache_prefill_and_decode_equal_one_forward(fields):
    """A user-built StaticCache continued by a prefill, a chunked prefill and single tokens (also from an empty
    cache) gives the logits of one forward, and after a reset the same again."""
    model = tiny_model(**{"rope_mode": "keep", **fields})
    ids, mask = left_padded_batch(lengths=(12, 7, 10))
    valid = mask.bool()
    expected = model(ids, attention_mask=mask).logits[valid]

    cache = StaticCache(config=model.config, max_cache_len=16)
    path_layers = [layer_type == "path_attention" for layer_type in model.config.layer_types]
    assert [isinstance(layer, PaTHStaticCacheLayer) for layer in cache.layers] == path_layers
    for cuts in ([0, 4, 9, 10, 12], [0, *range(1, 13)]):
        cache.reset()
        logits, _ = forward_in_pieces(model, ids, mask, cuts, cache=cache)
        torch.testing.assert_close(logits[valid], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "cache_factory",
    [DynamicCache, lambda: StaticCache(config=LlamaConfig(**TINY), max_cache_len=9)],
    ids=["dynamic", "static-llama-config"],
)
def test_cache_built_without_config(cache_factory):
    """A cache that does not know the PaTH layers (no config, or a Llama config) gets PaTH layers of its kind."""
    model = tiny_model(path_layers=[0])
    ids, mask = left_padded_batch()
    expected, _ = forward_in_pieces(model, ids, mask, [0, 5, 6, 9])
    logits, cache = forward_in_pieces(model, ids, mask, [0, 5, 6, 9], cache=cache_factory())
    path_class = PaTHStaticCacheLayer if isinstance(cache, StaticCache) else PaTHCacheLayer
    assert isinstance(cache.layers[0], path_class) and not isinstance(cache.layers[1], path_class)
    torch.testing.assert_close(logits, expected)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_cache_cannot_be_cropped(static):
    model = tiny_model()
    ids, mask = left_padded_batch()
    cache = StaticCache(config=model.config, max_cache_len=12) if static else None
    _, cache = forward_in_pieces(model, ids, mask, [0, 9], cache=cache)
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(-2)


def test_cache_layer_gate_and_batch_bookkeeping():
    layer = PaTHCacheLayer()
    g1, g2 = -torch.rand(2, 5, 3), -torch.rand(2, 1, 3)
    layer.update(torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4))
    layer.update_gate(g1)
    layer.update_conv_state(torch.randn(2, 5, 6), state_size=2)
    gate = layer.update_gate(g2)
    g = torch.cat([g1, g2], dim=1).transpose(1, 2)  # [B, HQ, S]
    expected = torch.stack([g[..., j + 1 :].sum(-1) for j in range(6)], dim=-1)  # sum_{j < s <= e} g_s
    torch.testing.assert_close(gate, expected)

    states = {name: getattr(layer, name).clone() for name in ("keys", "values", "conv_state", "gate")}
    layer.update(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4))
    states["keys"], states["values"] = layer.keys.clone(), layer.values.clone()
    layer.reorder_cache(torch.tensor([1, 1]))
    layer.batch_repeat_interleave(2)
    layer.batch_select_indices(torch.tensor([0, 3]))
    for name, before in states.items():
        torch.testing.assert_close(getattr(layer, name), before[[1, 1]])


@pytest.mark.parametrize("num_beams", [1, 3], ids=["greedy", "beam3"])
def test_generation_with_buffers_that_fill_equals_recompute(monkeypatch, num_beams):
    """Decode steps write into buffers with room to grow; with room for a token or two at a time they fill and are
    replaced every other step, and beams replace them too: generation still equals recomputing every step."""
    monkeypatch.setattr(PaTHCacheLayer, "GROWTH_TOKENS", 1)
    model = tiny_model(rope_mode="keep")
    ids, mask = left_padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, num_beams=num_beams)
    kwargs.update(return_dict_in_generate=True, output_logits=True)
    cached, recomputed = (model.generate(ids, use_cache=use_cache, **kwargs) for use_cache in (True, False))
    torch.testing.assert_close(cached.sequences, recomputed.sequences, rtol=0, atol=0)
    for step_cached, step_recomputed in zip(cached.logits, recomputed.logits, strict=True):
        torch.testing.assert_close(step_cached, step_recomputed, rtol=1e-4, atol=1e-4)


def test_decode_update_writes_in_place_until_the_buffer_is_full(monkeypatch):
    """`PaTHCacheLayer.decode_update` keeps the keys and values of `path_decode_update` and `torch.cat` (what it
    replaces), in the same storage from step to step until that storage is full."""
    monkeypatch.setattr(PaTHCacheLayer, "GROWTH_TOKENS", 3)
    B, H, D = 2, 3, 8
    layer = PaTHCacheLayer()
    keys, values = torch.randn(B, H, 5, D), torch.randn(B, H, 5, D)
    layer.update(keys.clone(), values.clone())
    previous = None  # (storage address, capacity in tokens, length) before the step
    for _ in range(14):
        w = torch.nn.functional.normalize(torch.randn(B, H, D), dim=-1)
        beta, new_key, new_value = 2 * torch.rand(B, H), torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
        keys = torch.cat([path_decode_update(keys, w, beta), new_key], dim=-2)
        values = torch.cat([values, new_value], dim=-2)
        out_keys, out_values = layer.decode_update(w, beta, new_key, new_value)
        torch.testing.assert_close(out_keys, keys)
        torch.testing.assert_close(out_values, values, rtol=0, atol=0)
        assert out_keys is layer.keys and out_values is layer.values
        capacity = layer.keys.untyped_storage().nbytes() // (B * H * D * layer.keys.element_size())
        assert capacity >= layer.keys.shape[-2]
        if previous is not None:
            address, previous_capacity, previous_length = previous
            assert (layer.keys.data_ptr() == address) == (previous_capacity > previous_length)
        previous = (layer.keys.data_ptr(), capacity, layer.keys.shape[-2])
