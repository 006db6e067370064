"""lab/smollm2/passkey_probe.py: its PaTH window (with or without the first chunk as a sink) is a chunk-granular
cut of the brute-force attention, and each prompt's verdict and likelihood are `answer_scores`' under the variant,
the model restored after it."""

import json

import pytest
import torch

from lab.smollm2 import passkey_probe as probe
from path_hf import PaTHLlamaConfig, PaTHLlamaForCausalLM
from path_hf.evaluation import answer_scores, passkey_windows
from path_hf.ops import path_attention
from tests.evaluation.eval_models import shapes
from tests.ops.path_reference import make_inputs, path_scores_reference


def windowed_reference(inputs: dict, chunk_size: int, steps: int, sink: bool) -> torch.Tensor:
    """Brute-force gated PaTH attention in which query i sees key j only when their chunks are at most `steps`
    apart, `i // C - j // C <= steps`, or (`sink`) when j is in the first chunk."""
    q, k, v, w, beta, g = (inputs[name].detach() for name in ("q", "k", "v", "w", "beta", "g"))
    T, D = q.shape[1], q.shape[-1]
    logits, _ = path_scores_reference(q, k, w, beta)
    gate = g.cumsum(1).transpose(1, 2)
    logits = logits + gate[..., :, None] - gate[..., None, :]
    chunk = torch.arange(T) // chunk_size
    far = chunk[:, None] - chunk[None, :] > steps
    if sink:
        far &= chunk[None, :] != 0
    logits = logits.masked_fill(far, float("-inf"))
    return ((D**-0.5 * logits).softmax(-1) @ v.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("sink", [False, True])
def test_path_window_cuts_the_attention_to_whole_chunks_and_is_undone_after(sink, tokenizer):
    inputs = make_inputs(1, 96, 2, 1, 8, gate=True)
    args = {name: inputs[name].detach() for name in ("q", "k", "v", "w", "beta", "g")}
    whole, _ = path_attention(**args, backend="torch", chunk_size=16)
    window = probe.path_window_sink if sink else probe.path_window
    # the knobs the probe sets, at the op: ceil(20 / 16) = 2 block diagonals, between 32 and 47 keys back
    torch.manual_seed(0)
    model = PaTHLlamaForCausalLM(PaTHLlamaConfig(**shapes(tokenizer), path_backend="torch")).eval()
    layers = [module for module in model.modules() if hasattr(module, "chunk_options")]
    with window(model, 20):
        options = {dict(layer.chunk_options)["window"] for layer in layers}
        knobs = dict(layers[0].chunk_options)
    assert options == {20} and len(layers) == model.config.num_hidden_layers
    cut, _ = path_attention(**args, backend="torch", chunk_size=16, chunk_options=knobs)
    torch.testing.assert_close(cut, windowed_reference(inputs, 16, steps=2, sink=sink), rtol=1e-9, atol=1e-9)
    assert (cut - whole).abs().amax() > 1e-3  # the window removes keys that mattered
    # and in the model: the cut changes its logits, and leaving the block restores them exactly
    ids = torch.randint(0, model.config.vocab_size, (1, 256))  # 4 chunks of 64, the layers' default: a cut
    with torch.no_grad():
        before = model(ids).logits
        with window(model, 20):
            during = model(ids).logits
        after = model(ids).logits
    assert (during - before).abs().amax() > 0
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert all(not layer.chunk_options for layer in layers)


def test_probe_scores_each_prompt_under_its_variant(checkpoints, tokenizer, tmp_path):
    model_path = checkpoints["path"]
    output = tmp_path / "probe.json"
    probe.main([
        "--model", str(model_path), "--length", "160", "--depths", "0.2,0.8", "--variant", "plain",
        "--variant", "temperature:0.5", "--output", str(output),
    ])  # fmt: skip
    report = json.loads(output.read_text())
    model = PaTHLlamaForCausalLM.from_pretrained(model_path).eval()
    windows = passkey_windows(tokenizer, 160, 1, depths=(0.2, 0.8))
    plain = answer_scores(model, windows, batch_size=1)
    model.config.path_attn_temperature_scale = 0.5  # past max_position_embeddings (32), inside these 160 tokens
    scaled = answer_scores(model, windows, batch_size=1)
    for variant, scores in (("plain", plain), ("temperature:0.5", scaled)):
        rows = report["variants"][variant]
        for index, key in enumerate(("trial0@0.2", "trial0@0.8")):
            assert rows[key]["correct"] == scores.all_correct[index]
            expected = scores.nll_sum[index] / scores.tokens[index]
            assert abs(rows[key]["answer_nll"] - expected) < 1e-5 * max(1.0, expected)
    assert plain.nll_sum != scaled.nll_sum  # the variant changed the model
    with pytest.raises(SystemExit, match="unknown variant change 'window:8'"):
        probe.main(["--model", str(model_path), "--length", "160", "--variant", "window:8", "--output", str(output)])


def test_gate_scale_multiplies_the_log_forget_gate_and_key_gate_sums_it_from_the_key(checkpoints, tokenizer, tmp_path):
    torch.manual_seed(0)
    config = PaTHLlamaConfig(
        **shapes(tokenizer), path_backend="torch", path_forget_gate=True, path_forget_gate_bias=2.0
    )
    model = PaTHLlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "gated")
    tokenizer.save_pretrained(tmp_path / "gated")
    output = tmp_path / "probe.json"
    variants = ["plain", "gate_scale:0.5", "gate_scale:0"]
    probe.main(["--model", str(tmp_path / "gated"), "--length", "160", "--depths", "0.2", "--output", str(output)]
               + [arg for variant in variants for arg in ("--variant", variant)])  # fmt: skip
    rows = {variant: json.loads(output.read_text())["variants"][variant]["trial0@0.2"] for variant in variants}
    windows = passkey_windows(tokenizer, 160, 1, depths=(0.2,))
    for variant, gain in (("plain", 1.0), ("gate_scale:0.5", 0.5), ("gate_scale:0", 0.0)):
        for layer in model.model.layers:  # the same scale, reached through the checkpoint's own per-head gain
            torch.nn.init.constant_(layer.self_attn.g_gain.weight, gain)
        expected = answer_scores(model, windows, batch_size=1)
        assert abs(rows[variant]["answer_nll"] - expected.nll_sum[0] / expected.tokens[0]) < 1e-5
    assert rows["plain"]["answer_nll"] != rows["gate_scale:0"]["answer_nll"]
    plain, half, off = (torch.tensor(rows[variant]["key_gate"]) for variant in variants)
    assert plain.shape == (config.num_hidden_layers, config.num_attention_heads) and (plain < -0.1).all()
    # the first layer's gate sees the same input in both (later layers' inputs change with the gate before them)
    torch.testing.assert_close(half[0], plain[0] / 2, rtol=0, atol=0.011)  # both rounded to 0.01
    assert (off == 0).all()
    with pytest.raises(SystemExit, match="gate_scale needs a model with a forget gate"):
        probe.main(["--model", str(checkpoints["path"]), "--length", "160", "--variant", "gate_scale:0",
                    "--output", str(tmp_path / "other.json")])  # fmt: skip


def test_key_gate_sums_each_head_from_after_the_needle_s_key_to_the_question():
    answer = torch.tensor([5, 7, 8, 9])  # a space, then the digits 7 8 9
    input_ids = torch.tensor([1, 2, 7, 8, 9, 3, 4, 6, 5, 7, 8, 9])  # the key ends at 4, the answer starts at 8
    log_gates = [-torch.arange(12.0)[None, :, None].expand(1, 12, 2)]
    # positions 5, 6 and 7 lie between the key and the answer: -(5 + 6 + 7) in each head
    assert probe.key_gate(log_gates, input_ids, answer) == [[-18.0, -18.0]]
    assert probe.key_gate(log_gates, torch.tensor([1, 2, 3, 4, 5, 6, 7, 5, 7, 8, 9, 0]), answer) is None
