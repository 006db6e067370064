"""`--verify`'s streamed forward: the source model's logits, with one decoder layer in memory at a time."""

import torch
from checkpoints import make_source
from transformers import AutoConfig, AutoModelForCausalLM

from conversion.verify import streamed_logits


def test_streamed_logits_hold_one_layer_at_a_time(tmp_path):
    source = make_source(tmp_path / "source", "qwen3", tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(source)
    state_dict = model.state_dict()
    loaded = []

    def check_earlier_layers_dropped(layer):
        assert all(param.device.type == "meta" for earlier in loaded for param in earlier.parameters())
        loaded.append(layer)

    input_ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(0))
    logits = streamed_logits(
        AutoConfig.from_pretrained(source),
        lambda name: state_dict[name].clone(),
        input_ids,
        prepare_layer=check_earlier_layers_dropped,
    )
    assert len(loaded) == 3
    with torch.no_grad():
        torch.testing.assert_close(logits, model(input_ids).logits, rtol=0, atol=1e-6)
