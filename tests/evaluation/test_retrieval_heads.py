"""`path_hf.evaluation.retrieval_heads`: the needle's attention mass is what eager attention gives at the positions
that predict the answer, averaged over the prompts, and the layers rank by their strongest head."""

import pytest
import torch
from transformers import LlamaForCausalLM

from path_hf.evaluation import (
    IGNORE_INDEX,
    PASSKEY_NEEDLE,
    Window,
    needle_mass,
    needle_span,
    passkey_windows,
    rank_retrieval_layers,
    retrieval_heads,
)


def eager_needle_mass(model, tokenizer, window) -> torch.Tensor:
    """The reference: one full forward pass with eager attention's weights; the needle found by brute force."""
    answer = window.labels != IGNORE_INDEX
    key = tokenizer.decode(window.input_ids[answer]).strip()
    needle = tokenizer(PASSKEY_NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
    ids = window.input_ids.tolist()
    (start,) = [i for i in range(len(ids)) if ids[i : i + len(needle)] == needle]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(window.input_ids[None], output_attentions=True).attentions
    model.set_attn_implementation("sdpa")
    first = int(answer.nonzero()[0])
    predicting = range(first - 1, len(ids) - 1)  # the prompt's last token, then every answer token but the last
    return torch.stack(
        [layer[0, :, predicting, start : start + len(needle)].sum(-1).mean(-1).double() for layer in attentions]
    )


def test_needle_mass_is_eager_attention_on_the_needle(checkpoints, tokenizer):
    model = LlamaForCausalLM.from_pretrained(checkpoints["llama"]).eval()
    (window,) = passkey_windows(tokenizer, 160, 1, depths=(0.5,))
    got = needle_mass(model, window, needle_span(tokenizer, window))
    assert got.shape == (model.config.num_hidden_layers, model.config.num_attention_heads)
    torch.testing.assert_close(got, eager_needle_mass(model, tokenizer, window), rtol=1e-5, atol=1e-6)


def test_retrieval_heads_average_the_prompts(checkpoints, tokenizer):
    model = LlamaForCausalLM.from_pretrained(checkpoints["llama"]).eval()
    windows = passkey_windows(tokenizer, 160, 2, seed=3, depths=(0.2, 0.7))
    expected = torch.stack([eager_needle_mass(model, tokenizer, window) for window in windows]).mean(0)
    got = retrieval_heads(model, tokenizer, 160, trials=2, depths=(0.2, 0.7), seed=3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_layers_rank_by_their_strongest_head():
    mass = torch.tensor([[0.1, 0.2], [0.9, 0.0], [0.2, 0.2], [0.0, 0.5], [0.1, 0.2]], dtype=torch.float64)
    assert rank_retrieval_layers(mass) == [1, 3, 0, 2, 4]  # a tie (0.2: layers 0, 2 and 4) keeps the lower first


def test_a_window_without_a_needle_is_refused(tokenizer):
    ids = torch.arange(10, 40)
    labels = torch.full_like(ids, IGNORE_INDEX)
    with pytest.raises(ValueError, match="no labelled answer"):
        needle_span(tokenizer, Window(ids, labels))
    labels[-3:] = ids[-3:]
    with pytest.raises(ValueError, match="is not in the window"):
        needle_span(tokenizer, Window(ids, labels))
