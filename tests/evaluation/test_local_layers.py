"""`lab/smollm2/local_layers.py`: the source as a no-training hybrid. Local layers against transformers' Mistral
(whose `sliding_window` is the same rule, computed by transformers' own masks), global layers with YaRN against
`path-hf eval`'s `rope_scaling`, and the script on a tiny checkpoint."""

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from lab.smollm2 import local_layers as script
from path_hf.evaluation import read_texts, rope_scaling, tokenize_stream
from tests.evaluation.eval_models import EVAL_DATA, shapes

LENGTH, WINDOW = 48, 12


def tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, LENGTH), generator=torch.Generator().manual_seed(seed))


def llama(checkpoints) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(checkpoints["llama"])
    model.set_attn_implementation("sdpa")
    return model


def mistral_twin(model: LlamaForCausalLM, sliding_window: int) -> MistralForCausalLM:
    """A Mistral with `model`'s weights and a sliding window: the independent reference of the local layers."""
    config = MistralConfig(**{**model.config.to_dict(), "sliding_window": sliding_window, "model_type": "mistral"})
    twin = MistralForCausalLM(config)
    twin.load_state_dict(model.state_dict())
    twin.set_attn_implementation("eager")
    return twin.eval()


def test_local_layers_match_mistral_sliding_window(checkpoints):
    model = llama(checkpoints)
    input_ids = tokens(model.config.vocab_size)
    script.hybrid(model, LENGTH, WINDOW, sinks=0, globals_=[], yarn=None)
    with torch.no_grad():
        expected = mistral_twin(model, WINDOW)(input_ids).logits
        plain = LlamaForCausalLM.from_pretrained(model.config._name_or_path)(input_ids).logits
        got = model(input_ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the first WINDOW positions see every key, the later ones do not
    torch.testing.assert_close(got[:, :WINDOW], plain[:, :WINDOW], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[:, WINDOW:], plain[:, WINDOW:], atol=1e-3)


def test_sinks_and_global_layers_see_every_key(checkpoints):
    """Sinks covering the whole window, or every layer global without YaRN, give back the plain model."""
    model = llama(checkpoints)
    input_ids = tokens(model.config.vocab_size, seed=1)
    with torch.no_grad():
        plain = model(input_ids).logits
        for sinks, globals_ in ((LENGTH, []), (0, [0, 1])):
            handles = script.hybrid(model, LENGTH, WINDOW, sinks=sinks, globals_=globals_, yarn=None)
            torch.testing.assert_close(model(input_ids).logits, plain, rtol=1e-5, atol=1e-5)
            for handle in handles:
                handle.remove()


def test_sinks_are_the_first_keys(checkpoints):
    """A sink is seen by every query: the local layers with one sink differ from the window alone exactly past it."""
    model = llama(checkpoints)
    input_ids = tokens(model.config.vocab_size, seed=2)
    mask = script.local_mask(LENGTH, WINDOW, sinks=2)[0, 0]
    assert mask[:, :2].sum(0).tolist() == [LENGTH, LENGTH - 1]  # every query from the key's own position on
    assert mask.sum(-1).tolist() == [min(i + 1, WINDOW + (i >= WINDOW) + (i >= WINDOW + 1)) for i in range(LENGTH)]
    with torch.no_grad():
        handles = script.hybrid(model, LENGTH, WINDOW, sinks=1, globals_=[], yarn=None)
        with_sink = model(input_ids).logits
        for handle in handles:
            handle.remove()
        script.hybrid(model, LENGTH, WINDOW, sinks=0, globals_=[], yarn=None)
        without = model(input_ids).logits
    torch.testing.assert_close(with_sink[:, :WINDOW], without[:, :WINDOW], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(with_sink[:, WINDOW:], without[:, WINDOW:], atol=1e-4)


def test_global_layers_take_yarn_as_path_hf_eval_applies_it(checkpoints):
    """Every layer global with YaRN is the source with YaRN as `path-hf eval --model PATH@yarn:F` measures it; one
    global layer of two is neither that nor all-local."""
    model = llama(checkpoints)
    input_ids = tokens(model.config.vocab_size, seed=3)
    with torch.no_grad():
        with rope_scaling(model, "yarn", 4.0):
            expected = model(input_ids).logits
        handles = script.hybrid(model, LENGTH, WINDOW, sinks=0, globals_=[0, 1], yarn=4.0)
        torch.testing.assert_close(model(input_ids).logits, expected, rtol=1e-5, atol=1e-5)
        for handle in handles:
            handle.remove()
        script.hybrid(model, LENGTH, WINDOW, sinks=0, globals_=[1], yarn=4.0)
        mixed = model(input_ids).logits
    assert not torch.allclose(mixed[:, WINDOW:], expected[:, WINDOW:], atol=1e-4)


def test_global_layers_every_k_and_listed():
    assert script.global_layers(30, 4, None) == [3, 7, 11, 15, 19, 23, 27]
    assert script.global_layers(30, 1, None) == list(range(30))
    assert script.global_layers(30, None, None) == []
    assert script.global_layers(30, None, [5, 2, 5]) == [2, 5]
    with pytest.raises(ValueError, match=r"--global-layers \[30\]"):
        script.global_layers(30, None, [30])


def test_script_writes_the_perplexities(checkpoints, tokenizer, tmp_path, capsys):
    output = tmp_path / "local.json"
    argv = ["--model", str(checkpoints["llama"]), "--data", str(EVAL_DATA), "--length", "64", "--window", "16"]
    assert script.main([*argv, "--sinks", "1", "--global-layers", "1", "--yarn", "2", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    assert report["data"] == ["examples/default_model/data/eval.jsonl.xz"]  # relative to the repository
    assert (report["length"], report["window"], report["sinks"], report["global_layers"], report["yarn"]) == (
        64,
        16,
        1,
        [1],
        2.0,
    )
    model = llama(checkpoints)
    script.hybrid(model, 64, 16, sinks=1, globals_=[1], yarn=2.0)
    stream = torch.tensor([tokenize_stream(read_texts([EVAL_DATA]), tokenizer, max_tokens=64)])
    nll = script.token_nll(model, stream)
    assert report["ppl"] == pytest.approx(math.exp(nll.mean()), rel=1e-6)
    assert report["ppl_first_half"] == pytest.approx(math.exp(nll[:31].mean()), rel=1e-6)
    assert report["ppl_second_half"] == pytest.approx(math.exp(nll[31:].mean()), rel=1e-6)
    assert "global layers [1], window 16, sinks 1" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--window", "0"], "need T >= 4, W >= 1"),
        (["--window", "16", "--global-layers", "2"], "--global-layers [2]: the model has layers 0 to 1"),
        (["--window", "16", "--data", "SHORT"], "fewer than --length 64"),
    ],
)
def test_script_refuses_bad_input(checkpoints, tmp_path, capsys, extra, message):
    output = tmp_path / "local.json"
    short = tmp_path / "short.txt"
    short.write_text("Too short a text for the window.\n")
    extra = [str(short) if arg == "SHORT" else arg for arg in extra]
    argv = ["--model", str(checkpoints["llama"]), "--data", str(EVAL_DATA), "--length", "64", *extra]
    assert script.main([*argv, "--output", str(output)]) == 1
    assert message in capsys.readouterr().err
    assert not output.exists()


def test_renumbered_sinks_without_sinks_are_the_window(checkpoints, monkeypatch):
    """The blockwise attention of renumbered sinks, with no sink, is Mistral's sliding window (blocks of 5 queries)."""
    monkeypatch.setattr(script, "BLOCK", 5)
    model = llama(checkpoints)
    input_ids = tokens(model.config.vocab_size, seed=4)
    script.hybrid(model, LENGTH, WINDOW, sinks=0, globals_=[], yarn=None, renumber_sinks=True)
    with torch.no_grad():
        expected = mistral_twin(model, WINDOW)(input_ids).logits
        got = model(input_ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_renumbered_sinks_are_sinks_until_the_window_is_full(checkpoints, monkeypatch):
    """Up to query `window - 1 + sinks` the renumbering moves nothing: the same as sinks at their own positions."""
    monkeypatch.setattr(script, "BLOCK", 7)
    sinks = 3
    model = llama(checkpoints)
    input_ids = tokens(model.config.vocab_size, seed=5)
    with torch.no_grad():
        handles = script.hybrid(model, LENGTH, WINDOW, sinks=sinks, globals_=[], yarn=None)
        own = model(input_ids).logits
        for handle in handles:
            handle.remove()
        script.hybrid(model, LENGTH, WINDOW, sinks=sinks, globals_=[], yarn=None, renumber_sinks=True)
        renumbered = model(input_ids).logits
    cap = WINDOW - 1 + sinks
    torch.testing.assert_close(renumbered[:, : cap + 1], own[:, : cap + 1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(renumbered[:, cap + 1 :], own[:, cap + 1 :], atol=1e-4)


def test_renumbered_sinks_match_streamingllm_cache(tokenizer):
    """One layer: query i with renumbered sinks computes what the plain Llama computes for StreamingLLM's cache, the
    sinks then the window's tokens at consecutive positions 0, 1, ..., with the query last."""
    config = LlamaConfig(**{**shapes(tokenizer), "num_hidden_layers": 1, "max_position_embeddings": LENGTH})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    plain = LlamaForCausalLM(config).eval()
    plain.load_state_dict(model.state_dict())
    plain.set_attn_implementation("sdpa")
    input_ids = tokens(config.vocab_size, seed=6)
    sinks = 2
    script.hybrid(model, LENGTH, WINDOW, sinks=sinks, globals_=[], yarn=None, renumber_sinks=True)
    with torch.no_grad():
        got = model(input_ids).logits
        for i in (WINDOW + sinks, WINDOW + sinks + 5, LENGTH - 1):
            cache = torch.cat([input_ids[:, :sinks], input_ids[:, i - WINDOW + 1 : i + 1]], dim=1)
            torch.testing.assert_close(got[:, i], plain(cache).logits[:, -1], rtol=1e-5, atol=1e-5)
