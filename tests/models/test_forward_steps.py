"""The named steps of the PaTH and local layers' forwards: the cache layer each layer takes (`_cache_layer`, written
once for both), the padding mask and temperature checks, and the source's context (`source_context`, the one rule its
users share)."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.cache_utils import DynamicCache, DynamicLayer, StaticLayer

from path_hf import LocalCacheLayer, PaTHCacheLayer, PaTHStaticCacheLayer
from path_hf.configuration_path_llama import source_context
from path_hf.conversion.plan import source_context as plan_source_context
from path_hf.evaluation import model_train_length
from tests.models.tiny_models import random_tokens, tiny_model, tiny_model_config

# Layer 0 is a PaTH layer, layer 1 a local one.
HYBRID = dict(path_layers=[0], local_window=4)


def _filled(layer_idx: int) -> DynamicCache:
    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), layer_idx)
    return cache


def test_a_bare_cache_gets_each_layer_its_own_class():
    model = tiny_model(**HYBRID)
    cache = DynamicCache()
    with torch.no_grad():
        model(random_tokens(1, 6), cache=cache, use_cache=True)
    assert [type(layer) for layer in cache.layers] == [PaTHCacheLayer, LocalCacheLayer]

    cache = DynamicCache()
    cache.layers = [StaticLayer(16), DynamicLayer()]
    with torch.no_grad():
        model(random_tokens(1, 6), cache=cache, use_cache=True)
    assert [type(layer) for layer in cache.layers] == [PaTHStaticCacheLayer, LocalCacheLayer]
    assert cache.layers[0].max_cache_len == 16
    layers = list(cache.layers)
    with torch.no_grad():
        model(random_tokens(1, 1), cache=cache, use_cache=True)
    assert all(found is layer for found, layer in zip(cache.layers, layers, strict=True))  # found, not replaced again


@pytest.mark.parametrize(
    ("layer_idx", "message"),
    [
        (0, "Layer 0 is a PaTH layer but its cache is a DynamicLayer that already holds keys: build the cache"),
        (1, "Layer 1 is a local layer (local_window) but its cache is a DynamicLayer that already holds keys: local"),
    ],
)
def test_a_cache_layer_holding_keys_is_refused(layer_idx, message):
    model = tiny_model(**HYBRID)
    with pytest.raises(ValueError) as error, torch.no_grad():
        model(random_tokens(1, 6), cache=_filled(layer_idx), use_cache=True)
    assert str(error.value).startswith(message)


def test_a_local_layer_refuses_a_static_layer():
    model = tiny_model(**HYBRID)
    cache = DynamicCache()
    cache.layers = [DynamicLayer(), StaticLayer(16)]
    with (
        pytest.raises(ValueError, match=r"Layer 1 is a local layer \(local_window\) but its cache is a StaticLayer: "),
        torch.no_grad(),
    ):
        model(random_tokens(1, 6), cache=cache, use_cache=True)


def test_path_layers_take_a_2d_mask_and_position_ids_for_the_temperature():
    model = tiny_model(path_attn_temperature_scale=0.1, path_attn_temperature_length=4)
    attention = model.model.layers[0].self_attn
    hidden = torch.randn(1, 5, model.config.hidden_size)
    with pytest.raises(ValueError, match="2-D padding mask"), torch.no_grad():
        attention(hidden, attention_mask=torch.ones(1, 1, 5, 5))
    with pytest.raises(ValueError, match="needs the position_ids"), torch.no_grad():
        attention(hidden)


@pytest.mark.parametrize(
    ("rope_parameters", "context"),
    [
        ({"rope_type": "default", "rope_theta": 1e4}, 64),
        ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}, 16),
    ],
)
def test_the_source_context_is_one_rule(rope_parameters, context):
    source = LlamaConfig(max_position_embeddings=64, rope_parameters=rope_parameters)
    path_config = tiny_model_config(max_position_embeddings=64, rope_parameters=rope_parameters)
    assert source_context(source) == source_context(path_config) == context
    assert (
        plan_source_context(source)
        == model_train_length(source, None)
        == path_config.attn_temperature_length
        == context
    )
    assert model_train_length(source, 5) == 5
