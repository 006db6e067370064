"""Passkey prompts and their scoring against greedy generation; per-position perplexity; RoPE scaling in place."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from path_hf.evaluation import (
    IGNORE_INDEX,
    PASSKEY_FILLER,
    Window,
    answer_accuracy,
    passkey_accuracy,
    passkey_windows,
    perplexity,
    rope_parameters_for,
    rope_scaling,
)


@pytest.fixture(scope="module")
def llama(checkpoints):
    return AutoModelForCausalLM.from_pretrained(checkpoints["llama"]).eval()


def test_passkey_prompts(tokenizer):
    windows = passkey_windows(tokenizer, 512, trials=6, seed=3)
    filler = len(tokenizer(PASSKEY_FILLER, add_special_tokens=False)["input_ids"])
    keys, depths = set(), set()
    for window in windows:
        assert 512 - filler < len(window.input_ids) <= 512  # as much filler as fits
        answer = window.labels[window.labels != IGNORE_INDEX]
        assert (window.labels[: len(window.input_ids) - len(answer)] == IGNORE_INDEX).all()  # the key ends it
        key = tokenizer.decode(answer).strip()
        assert len(key) == 5 and key.isdigit()
        prompt = tokenizer.decode(window.input_ids[: -len(answer)])
        assert prompt.count(key) == 2 and prompt.endswith("The pass key is")
        keys.add(key)
        depths.add(prompt.index(key))
    assert len(keys) == 6 and len(depths) > 1  # keys and depths vary from trial to trial
    again = passkey_windows(tokenizer, 512, trials=6, seed=3)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(windows, again, strict=True))
    with pytest.raises(ValueError, match="too short for a passkey prompt"):
        passkey_windows(tokenizer, 40, trials=1)


def test_answer_accuracy_is_greedy_decoding(llama, tokenizer):
    """A window counts exactly when `generate` (greedy) writes its labelled tokens."""
    windows = []
    for trial, window in enumerate(passkey_windows(tokenizer, 128, trials=3)):
        prompt = window.input_ids[window.labels == IGNORE_INDEX][: 80 + 7 * trial]  # three lengths
        generated = llama.generate(prompt[None], max_new_tokens=3, do_sample=False, pad_token_id=0)[0, len(prompt) :]
        right = torch.cat([prompt, generated])
        wrong = right.clone()
        wrong[-1 - trial % 3] = (wrong[-1 - trial % 3] + 1) % len(tokenizer)  # one answer token off
        for ids in (right, wrong):
            labels = torch.full_like(ids, IGNORE_INDEX)
            labels[len(prompt) :] = ids[len(prompt) :]
            windows.append(Window(ids, labels))
    # Windows of three lengths in one batch: padding must not change a verdict.
    assert answer_accuracy(llama, windows, batch_size=6) == [True, False] * 3
    assert answer_accuracy(llama, windows, batch_size=1) == [True, False] * 3
    # the fraction of its prompts' verdicts, each the greedy verdict above
    prompts = passkey_windows(tokenizer, 128, trials=4)
    assert passkey_accuracy(llama, tokenizer, 128, trials=4) == sum(answer_accuracy(llama, prompts, 1)) / 4


def test_perplexity_by_position(llama):
    stream = torch.randint(0, 4000, (100,), generator=torch.Generator().manual_seed(0))
    result = perplexity(llama, stream, context_length=40, batch_size=2)
    nll = torch.zeros(40, dtype=torch.float64)
    count = torch.zeros(40)
    for begin in range(0, 100, 40):
        ids = stream[begin : begin + 40]
        with torch.no_grad():
            logits = llama(input_ids=ids[None]).logits[0, :-1].double()
        n = len(ids) - 1
        nll[1 : n + 1] += -F.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]
        count[1 : n + 1] += 1
    assert result.position_tokens == tuple(count.long().tolist())
    assert result.ppl_between(20) == pytest.approx(math.exp(nll[20:].sum() / count[20:].sum()), rel=1e-6)
    assert result.ppl_between(0) == pytest.approx(result.ppl, rel=1e-9)
    assert math.isnan(result.ppl_between(40))
    both = result + perplexity(llama, stream[:30], context_length=40)
    assert both.tokens == result.tokens + 29 and len(both.position_nll) == 40


def test_rope_scaling_swaps_and_restores(llama):
    stream = torch.randint(0, 4000, (128,), generator=torch.Generator().manual_seed(1))
    before = perplexity(llama, stream, 128).nll_sum
    original = llama.model.rotary_emb
    with rope_scaling(llama, "yarn", factor=4.0, original_length=32) as scaled:
        assert scaled.model.rotary_emb is not original
        assert scaled.model.rotary_emb.rope_type == "yarn"
        assert perplexity(scaled, stream, 128).nll_sum != pytest.approx(before)
    assert llama.model.rotary_emb is original
    assert llama.config.rope_parameters["rope_type"] == "default"  # the model's own config is untouched
    assert perplexity(llama, stream, 128).nll_sum == pytest.approx(before, rel=1e-9)
    with pytest.raises(ValueError, match="unknown RoPE scaling 'ntk'"):
        with rope_scaling(llama, "ntk", 2.0):
            pass


def test_the_training_context_of_a_rope_scaled_source_is_its_original_length():
    """A source whose RoPE is already scaled (Llama 3's: 8192 tokens trained, 131072 positions) is rescaled from
    its training context, `original_max_position_embeddings`, as `source_context` reads it; a plain one from
    `max_position_embeddings`."""
    from transformers import LlamaConfig

    from path_hf.configuration_path_llama import source_context

    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0}
    llama3 |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    scaled = LlamaConfig(max_position_embeddings=131072, rope_parameters=llama3)
    plain = LlamaConfig(max_position_embeddings=4096)
    assert source_context(scaled) == 8192 and source_context(plain) == 4096
    assert rope_parameters_for(scaled, "yarn", 2.0)["original_max_position_embeddings"] == 8192
    assert rope_parameters_for(plain, "yarn", 2.0)["original_max_position_embeddings"] == 4096
    assert rope_parameters_for(scaled, "yarn", 2.0, original_length=1000)["original_max_position_embeddings"] == 1000


@pytest.mark.parametrize("kind", ["llama", "path"])
def test_logits_formed_a_chunk_at_a_time_score_what_the_whole_logits_score(checkpoints, kind):
    """Long windows form their logits a few positions at a time; the per-token scores are those of one forward."""
    from path_hf.evaluation import scoring as evaluation

    model = AutoModelForCausalLM.from_pretrained(checkpoints[kind]).eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 23), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # a right-padded row
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    expected = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")
    assert evaluation.output_head(model) is not None
    with torch.no_grad():
        chunked = evaluation.model_token_nll(model, ids, mask, targets, "cpu", logits_chunk=5)
    torch.testing.assert_close(chunked, expected, rtol=1e-5, atol=1e-5)
    assert (chunked[1, 16:] == 0).all() and (chunked[0] > 0).all()
