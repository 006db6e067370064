"""Local RoPE layers (`local_window`, `local_sinks`): against transformers' Mistral sliding window, a plain Llama run
on StreamingLLM's cache, the model without a cache, and one sequence a row; the references hold for both ways of
computing a block of the window, PyTorch's fused attention and the explicit products it falls back to."""

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

import path_hf.local_attention as local_attention
from path_hf import LocalCacheLayer, PaTHLlamaConfig, PaTHLlamaForCausalLM
from tests.models.tiny_models import TINY, random_tokens, tiny_model_config

LENGTH, WINDOW = 40, 8


@pytest.fixture(params=["fused", "explicit"])
def products(request, monkeypatch) -> str:
    """Each block of the window in PyTorch's fused attention (where it exists), or in the explicit products."""
    if request.param == "explicit":
        monkeypatch.setattr(local_attention, "FUSED_ATTENTION", None)
    else:
        assert local_attention.FUSED_ATTENTION is not None, "this PyTorch has no fused CPU attention with log-sum-exp"
    return request.param


def local_model(seed: int = 0, **overrides) -> PaTHLlamaForCausalLM:
    torch.manual_seed(seed)
    return PaTHLlamaForCausalLM(tiny_model_config(**{"local_window": WINDOW, **overrides})).eval()


def twin(model: PaTHLlamaForCausalLM, cls, config_cls, attention: str = "eager", **fields):
    """A transformers model of class `cls` with `model`'s weights (every layer a RoPE layer)."""
    reference = cls(config_cls(**{**TINY, "initializer_range": 0.2, **fields})).eval()
    reference.load_state_dict(model.state_dict())
    reference.set_attn_implementation(attention)
    return reference


@pytest.mark.parametrize("block", [3, 1024])
def test_local_layers_are_mistral_sliding_window(block, monkeypatch, products):
    monkeypatch.setattr(local_attention, "BLOCK", block)
    model = local_model(path_layers=[])
    input_ids = random_tokens(2, LENGTH, seed=1)
    with torch.no_grad():
        got = model(input_ids).logits
        expected = twin(model, MistralForCausalLM, MistralConfig, sliding_window=WINDOW)(input_ids).logits
        plain = twin(model, LlamaForCausalLM, LlamaConfig)(input_ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, :WINDOW], plain[:, :WINDOW], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[:, WINDOW:], plain[:, WINDOW:], atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prefill_within_the_window_is_causal_attention(dtype, monkeypatch):
    """A prefill of unpadded rows no longer than the window takes SDPA's causal kernel: Llama's attention (the sinks
    then stand at their own positions), to rounding in float64; padded rows or a longer prefill take the blocks."""
    taken = []
    within = local_attention.within_window
    monkeypatch.setattr(local_attention, "within_window", lambda *args: taken.append(within(*args)) or taken[-1])
    model = local_model(path_layers=[], local_sinks=2).to(dtype)
    plain = twin(model, LlamaForCausalLM, LlamaConfig, "sdpa").to(dtype)
    input_ids = random_tokens(2, WINDOW, seed=11)
    with torch.no_grad():
        got, expected = model(input_ids).logits, plain(input_ids).logits
        assert taken == [True] * model.config.num_hidden_layers
        padded = torch.ones_like(input_ids)
        padded[1, :3] = 0
        model(input_ids, attention_mask=padded), model(random_tokens(1, WINDOW + 1, seed=12))
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    assert not any(taken[model.config.num_hidden_layers :])


@pytest.mark.parametrize("sinks", [1, 3])
def test_renumbered_sinks_are_streamingllm_cache(sinks, products):
    """One local layer: query i computes what a plain Llama computes on StreamingLLM's cache, the sinks then the
    window's tokens at consecutive positions 0, 1, ..., the query last."""
    model = local_model(path_layers=[], num_hidden_layers=1, local_sinks=sinks)
    plain = twin(model, LlamaForCausalLM, LlamaConfig, num_hidden_layers=1)
    input_ids = random_tokens(1, LENGTH, seed=2)
    with torch.no_grad():
        got = model(input_ids).logits
        for i in (WINDOW - 1, WINDOW + sinks - 1, WINDOW + sinks, LENGTH - 1):
            kept = torch.cat([input_ids[:, :sinks], input_ids[:, max(sinks, i - WINDOW + 1) : i + 1]], dim=1)
            torch.testing.assert_close(got[:, i], plain(kept).logits[:, -1], rtol=1e-5, atol=1e-5)


def test_sinks_and_path_layers_mix():
    """A hybrid (PaTH layer 1, local layer 0) differs from the same weights with the RoPE layer global past the window,
    and is the same before it."""
    hybrid = local_model(path_layers=[1], local_sinks=2)
    torch.manual_seed(0)
    full = PaTHLlamaForCausalLM(tiny_model_config(path_layers=[1])).eval()
    full.load_state_dict(hybrid.state_dict())
    input_ids = random_tokens(1, LENGTH, seed=3)
    with torch.no_grad():
        got, expected = hybrid(input_ids).logits, full(input_ids).logits
    torch.testing.assert_close(got[:, : WINDOW + 2], expected[:, : WINDOW + 2], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[:, WINDOW + 2 :], expected[:, WINDOW + 2 :], atol=1e-3)


@pytest.mark.parametrize("prefill", [1, 5, 13])
def test_cache_decodes_what_the_full_forward_computes(prefill):
    """Prefill then decode one token at a time (and a chunk), a left-padded batch: the logits of the forward without
    cache, and a cache that keeps the sinks and the last window - 1 tokens only."""
    sinks = 2
    model = local_model(path_layers=[1], local_sinks=sinks)
    input_ids = random_tokens(2, LENGTH, seed=4)
    mask = torch.ones_like(input_ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        full = model(input_ids, attention_mask=mask).logits
        cache = DynamicCache(config=model.config)
        steps = [model(input_ids[:, :prefill], attention_mask=mask[:, :prefill], cache=cache, use_cache=True).logits]
        t = prefill
        while t < LENGTH:
            step = 1 if t < 25 else 4
            steps.append(
                model(
                    input_ids[:, t : t + step], attention_mask=mask[:, : t + step], cache=cache, use_cache=True
                ).logits
            )
            t += step
    got = torch.cat(steps, dim=1)
    torch.testing.assert_close(got[0], full[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1, 3:], full[1, 3:], rtol=1e-4, atol=1e-4)
    layer = cache.layers[0]
    assert isinstance(layer, LocalCacheLayer) and layer.get_seq_length() == LENGTH
    assert layer.keys.shape[2] == 3 + sinks + WINDOW - 1  # the padding before the sinks, the sinks, the window


def test_padded_rows_are_their_sequences_alone(products):
    model = local_model(path_layers=[1], local_sinks=2)
    input_ids = random_tokens(2, LENGTH, seed=5)
    mask = torch.ones_like(input_ids)
    mask[1, :7] = 0
    with torch.no_grad():
        padded = model(input_ids, attention_mask=mask).logits
        alone = model(input_ids[1:, 7:]).logits
    torch.testing.assert_close(padded[1:, 7:], alone, rtol=1e-5, atol=1e-5)


def test_packed_sequences_never_see_each_other(products):
    model = local_model(path_layers=[1], local_sinks=2)
    a, b = random_tokens(1, 25, seed=6), random_tokens(1, 15, seed=7)
    position_ids = torch.cat([torch.arange(25), torch.arange(15)])[None]
    with torch.no_grad():
        packed = model(torch.cat([a, b], dim=1), position_ids=position_ids).logits
        alone = torch.cat([model(a).logits, model(b).logits], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_generate_round_trip_and_remote_code(tmp_path):
    model = local_model(path_layers=[1], local_sinks=2)
    model.generation_config.pad_token_id = 0
    prompt = random_tokens(1, 6, seed=8)
    expected = model.generate(prompt, max_new_tokens=LENGTH - 6, do_sample=False)
    with torch.no_grad():  # greedy: each token the argmax of the forward without cache
        logits = model(expected[:, :-1]).logits
    assert torch.equal(logits[0, 5:].argmax(-1), expected[0, 6:])
    model.save_pretrained(tmp_path)
    assert (tmp_path / "local_attention.py").is_file()
    for loaded in (
        PaTHLlamaForCausalLM.from_pretrained(tmp_path),
        AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True),
    ):
        assert (loaded.config.local_window, loaded.config.local_sinks) == (WINDOW, 2)
        assert torch.equal(loaded.generate(prompt, max_new_tokens=LENGTH - 6, do_sample=False), expected)


def test_layer_types_follow_the_window():
    config = tiny_model_config(num_hidden_layers=3, path_layers=[1], local_window=16)
    assert config.layer_types == ["local_attention", "path_attention", "local_attention"]
    assert tiny_model_config(num_hidden_layers=3, path_layers=[1]).layer_types[0] == "full_attention"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"path_layers": [1], "local_window": 0}, "local_window must be a positive number of tokens"),
        ({"local_window": 16}, "every layer is a PaTH layer"),
        ({"path_layers": [0, 1], "local_window": 16}, "every layer is a PaTH layer"),
        ({"path_layers": [1], "local_window": 16, "local_sinks": -1}, "local_sinks must be a number of tokens >= 0"),
        ({"path_layers": [1], "local_sinks": 4}, "they need local_window"),
    ],
)
def test_bad_local_fields_are_refused(fields, message):
    with pytest.raises((ValueError, StrictDataclassClassValidationError), match=message):
        PaTHLlamaConfig(**TINY, **fields)


def test_float64_stays_float64(products):
    """In float64 the window's softmax is float64 too: Mistral's sliding window to rounding (`--verify` needs 1e-14;
    its SDPA, since its eager attention takes the softmax in float32)."""
    model = local_model(path_layers=[]).double()
    input_ids = random_tokens(1, LENGTH, seed=9)
    with torch.no_grad():
        got = model(input_ids).logits
        expected = (
            twin(model, MistralForCausalLM, MistralConfig, "sdpa", sliding_window=WINDOW).double()(input_ids).logits
        )
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_decode_attention_weights_are_streamingllm_probabilities():
    """`output_attentions` at a decode step: the probabilities over every key seen, 0 outside the window and the sinks,
    and on the kept keys those of a plain Llama (eager) on StreamingLLM's cache; what `attention_mass` reads."""
    sinks = 2
    model = local_model(path_layers=[], num_hidden_layers=1, local_sinks=sinks)
    plain = twin(model, LlamaForCausalLM, LlamaConfig, num_hidden_layers=1)
    input_ids = random_tokens(1, LENGTH, seed=10)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids[:, :-1], cache=cache, use_cache=True)
        weights = model(input_ids[:, -1:], cache=cache, use_cache=True, output_attentions=True).attentions[0]
        kept = torch.cat([input_ids[:, :sinks], input_ids[:, LENGTH - WINDOW :]], dim=1)
        expected = plain(kept, output_attentions=True).attentions[0][:, :, -1:]
    assert weights.shape == (1, 4, 1, LENGTH)
    torch.testing.assert_close(weights[..., sinks : LENGTH - WINDOW], torch.zeros(1, 4, 1, LENGTH - WINDOW - sinks))
    got = torch.cat([weights[..., :sinks], weights[..., LENGTH - WINDOW :]], dim=-1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_fused_blocks_compute_the_explicit_products_values_and_gradients(monkeypatch):
    """The fused blocks (the renumbered sinks merged through the window's log-sum-exp) equal the explicit products in
    float64, without and with autograd, padded rows and sinks included; under autograd the blocks that see a
    renumbered sink take the explicit products (the fused op passes no gradient through its log-sum-exp)."""
    torch.manual_seed(0)
    batch, heads, length, dim, window = 2, 4, 90, 8, 16
    query = torch.randn(batch, heads, length, dim, dtype=torch.float64, requires_grad=True)
    key, value = (torch.randn(batch, 2, length, dim, dtype=torch.float64, requires_grad=True) for _ in range(2))
    positions = torch.arange(length).repeat(batch, 1)
    positions[1] = torch.arange(length) - 5  # five tokens of left padding
    positions[1, :5] = -1
    inv_freq = 1 / 1e4 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    weight = torch.randn(batch, length, heads, dim, dtype=torch.float64) * (positions >= 0)[..., None, None]
    calls = []
    op = local_attention.FUSED_ATTENTION
    monkeypatch.setattr(
        local_attention, "FUSED_ATTENTION", lambda *args, **kwargs: calls.append(1) or op(*args, **kwargs)
    )

    def run(grad: bool, fused: bool = True):
        with torch.set_grad_enabled(grad):
            out = local_attention.local_attention(
                query, key, value, positions, positions, window=window, sinks=3, inv_freq=inv_freq, scaling=0.3,
                block=10, fused=fused,
            )  # fmt: skip
        return out, torch.autograd.grad((out * weight).sum(), (query, key, value)) if grad else ()

    (got, _), (got_grad, grads) = run(False), run(True)
    assert len(calls) == 9 + 1  # every block without autograd; with it, the first block only (no sink renumbered)
    (expected, _), (_, expected_grads) = run(False, fused=False), run(True, fused=False)
    assert len(calls) == 9 + 1  # fused=False: no fused call
    valid = positions >= 0
    torch.testing.assert_close(got[valid], expected[valid], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad[valid], expected[valid], rtol=1e-12, atol=1e-12)
    for got_g, expected_g in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got_g, expected_g, rtol=1e-12, atol=1e-12)
    assert got.isfinite().all()  # the padding's rows too


def test_static_cache_is_refused_with_what_to_do():
    model = local_model(path_layers=[1], local_sinks=2)
    model.generation_config.pad_token_id = 0
    with pytest.raises(ValueError, match="Local layers \\(local_window\\) have no static cache: use the dynamic cache"):
        model.generate(random_tokens(1, 6), max_new_tokens=2, do_sample=False, cache_implementation="static")


def _o_proj_input(model, input_ids) -> torch.Tensor:
    """The heads' outputs of layer 0, concatenated (the input of its o_proj)."""
    seen = []
    hook = model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad():
        model(input_ids)
    hook.remove()
    return seen[0]


@pytest.mark.parametrize("sinks", [0, 2])
def test_full_heads_see_every_key(sinks, products):
    """`local_full_heads`: those heads of a local layer compute Llama's attention over every key, the others Mistral's
    sliding window (their renumbered sinks as without full heads); decoding from the cache, which then keeps every
    key, computes the same."""
    model = local_model(path_layers=[], local_sinks=sinks, local_full_heads=[[0, 1], [0, 3]])
    local = local_model(path_layers=[], local_sinks=sinks)
    local.load_state_dict(model.state_dict())
    plain = twin(model, LlamaForCausalLM, LlamaConfig)
    input_ids = random_tokens(2, LENGTH, seed=21)
    got, windowed, full = (_o_proj_input(m, input_ids).unflatten(-1, (4, -1)) for m in (model, local, plain))
    torch.testing.assert_close(got[:, :, [1, 3]], full[:, :, [1, 3]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, :, [0, 2]], windowed[:, :, [0, 2]], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[:, WINDOW + sinks :, 1], windowed[:, WINDOW + sinks :, 1], atol=1e-3)
    with torch.no_grad():
        whole = model(input_ids).logits
        cache = DynamicCache(config=model.config)
        steps = [model(input_ids[:, :9], cache=cache, use_cache=True).logits]
        steps += [model(input_ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(9, 20)]
        steps.append(model(input_ids[:, 20:], cache=cache, use_cache=True).logits)  # a piece after the cache
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-4, atol=1e-4)
    assert cache.layers[0].keys.shape[2] == LENGTH  # layer 0 holds full heads: every key kept
    assert cache.layers[1].keys.shape[2] == sinks + WINDOW - 1


def test_full_heads_take_the_global_rope():
    """A layer with full heads takes the rotary embedding that evaluation scales (`rope_scaling`, YaRN here); a local
    layer without them keeps its own."""
    from path_hf.evaluation import rope_scaling

    model = local_model(path_layers=[], local_full_heads=[[1, 0]])
    input_ids = random_tokens(1, LENGTH, seed=22)
    before = [_o_proj_input(model, input_ids)]
    with torch.no_grad(), rope_scaling(model, "yarn", 4.0, WINDOW):
        outputs = {}
        for index in (0, 1):
            hook = model.model.layers[index].self_attn.o_proj.register_forward_pre_hook(
                lambda module, args, index=index: outputs.__setitem__(index, args[0])
            )
            model(input_ids)
            hook.remove()
    torch.testing.assert_close(outputs[0], before[0])  # layer 0: no full head, its own RoPE
    reference = local_model(path_layers=[])
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        hook = reference.model.layers[1].self_attn.o_proj.register_forward_pre_hook(
            lambda module, args: outputs.__setitem__("unscaled", args[0])
        )
        reference(input_ids)
        hook.remove()
    assert not torch.allclose(outputs[1], outputs["unscaled"], atol=1e-4)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"local_full_heads": [[0, 1]]}, "set local_window"),
        ({"local_window": 8, "path_layers": [1], "local_full_heads": [[1, 0]]}, "layer 1 is not a local layer"),
        ({"local_window": 8, "path_layers": [], "local_full_heads": [[0, 9]]}, "query heads below 4"),
    ],
)
def test_bad_full_heads_are_refused(fields, message):
    with pytest.raises(StrictDataclassClassValidationError, match=message):
        tiny_model_config(**fields)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("position", [5, 9, 30])  # inside the window; sinks inside it; sinks renumbered
def test_decode_kernel_computes_the_blocks_attention(dtype, position):
    """One query a row over a cache of sinks and window keys (`LocalCacheLayer`'s layout, left-padded rows, 9 query
    heads on 3 key-value heads): `decode_attention` gives what the blocks give, without copying the
    keys per query head."""
    window, sinks, heads, kv_heads, dim = 8, 2, 9, 3, 16
    generator = torch.Generator().manual_seed(position)
    # the sinks, then the window's keys up to the query's own token, after two padding slots
    cached = list(range(min(position, sinks))) + list(range(max(sinks, position - window + 1), position + 1))
    key_positions = torch.tensor([[-1, -1] + cached, [-1, -1] + cached])
    length = key_positions.shape[1]
    query = torch.randn(2, heads, 1, dim, generator=generator, dtype=dtype)
    key = torch.randn(2, kv_heads, length, dim, generator=generator, dtype=dtype)
    value = torch.randn(2, kv_heads, length, dim, generator=generator, dtype=dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    arguments = dict(window=window, sinks=sinks, inv_freq=inv_freq, scaling=dim**-0.5)
    query_positions = torch.full((2, 1), position)
    kernel = local_attention.local_attention(query, key, value, query_positions, key_positions, **arguments)
    blocks = local_attention.local_attention(
        query, key, value, query_positions, key_positions, **arguments, decode_kernel=False, fused=False
    )
    assert kernel.shape == blocks.shape == (2, 1, heads, dim)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(kernel, blocks, rtol=tolerance, atol=tolerance)
