"""`--verify`: the streamed float64 forward, and the verdict: exact conversions of deeper models pass, a swapped or
slightly perturbed tensor fails with one line naming where the outputs first differ, whatever the logits' scale."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

import path_hf.conversion.convert
from path_hf.conversion.options import VERIFY_TOLERANCE
from path_hf.conversion.verify import (
    VerificationFailed,
    VerifyResult,
    relative_difference,
    rms_norm_in_dtype,
    streamed_logits,
)
from tests.conversion.checkpoints import convert_in_process, make_source


def failure_message(verification: VerifyResult) -> str:
    """The one line a conversion that differs from its source fails with."""
    return (
        "verification failed: the converted model's logits differ from the source's by "
        f"{verification.difference:.3g} x their std (limit {VERIFY_TOLERANCE:g}; float64, RoPE kept, transforms at "
        f"identity), first at {verification.first_differing}: the weight mapping is wrong."
    )


def edit_checkpoint(directory, edit) -> None:
    """Rewrite the single-file checkpoint in `directory` with `edit(tensors)` applied."""
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def perturb(tensors, name: str, relative: float = 1e-3) -> None:
    """Add noise of `relative` times the tensor's RMS: a tensor that is almost, but not exactly, copied."""
    tensor = tensors[name]
    noise = torch.randn(tensor.shape, generator=torch.Generator().manual_seed(1), dtype=tensor.dtype)
    tensors[name] = tensor + relative * tensor.square().mean().sqrt() * noise


def swap(tensors, first: str, second: str) -> None:
    tensors[first], tensors[second] = tensors[second], tensors[first]


def convert_with(monkeypatch, capsys, tmp_path, source, edit=None) -> tuple[VerifyResult, str, str | None]:
    """`path-hf convert --rope keep --init identity --verify` with `edit` applied to the written checkpoint before it
    is verified: (what the verification measured, stdout, the error's message or None if it passed)."""
    write_conversion = path_hf.conversion.convert.write_conversion

    def write_then_edit(plan, directory):
        write_conversion(plan, directory)
        if edit is not None:
            edit_checkpoint(directory, edit)

    output = tmp_path / "converted"
    with monkeypatch.context() as patch:
        patch.setattr(path_hf.conversion.convert, "write_conversion", write_then_edit)
        try:
            conversion, out = convert_in_process(
                capsys, "--from", source, "--to", output, "--rope", "keep", "--init", "identity", "--verify"
            )
        except VerificationFailed as failed:
            assert not output.exists()
            return failed.result, capsys.readouterr().out, str(failed)
    assert output.exists()
    return conversion.verification, out, None


def test_streamed_logits_hold_one_layer_at_a_time(tmp_path, monkeypatch):
    """Equal to the whole model's float64 forward (RMSNorms included), with earlier layers dropped, the embeddings
    read only at the rows of the input, and the head read in blocks of rows."""
    source = make_source(tmp_path / "source", "qwen3", tie_word_embeddings=True)
    monkeypatch.setattr(Qwen3RMSNorm, "forward", rms_norm_in_dtype)  # transformers' computes in float32
    model = AutoModelForCausalLM.from_pretrained(source).double()
    state_dict = model.state_dict()
    block = 100  # rows of the head at once: 256 = 100 + 100 + 56
    loaded, rows_read = [], []

    def load(name, rows=None):
        if rows is not None:
            rows_read.append((name, rows.start, rows.stop))
        return state_dict[name][rows if rows is not None else slice(None)].clone()

    def check_earlier_layers_dropped(layer):
        assert all(param.device.type == "meta" for earlier in loaded for param in earlier.parameters())
        loaded.append(layer)

    input_ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(0))
    logits = streamed_logits(
        AutoConfig.from_pretrained(source),
        load,
        input_ids,
        prepare_layer=check_earlier_layers_dropped,
        head_block_bytes=block * model.config.hidden_size * 8,
    )
    assert len(loaded) == 3
    embeddings = "model.embed_tokens.weight"
    assert rows_read == [(embeddings, i, i + 1) for i in input_ids[0].tolist()] + [
        (embeddings, 0, 100),
        (embeddings, 100, 200),
        (embeddings, 200, 300),
    ]
    with torch.no_grad():
        torch.testing.assert_close(logits, model(input_ids).logits, rtol=0, atol=1e-12)


def test_rounding_stays_far_below_the_limit(tmp_path):
    """Noise of 1e-12 on the embeddings moves the logits by about as much (not by the 1e-7 that float32 RMSNorms
    make of it): rounding is linear in float64 all through."""
    source = make_source(tmp_path / "source", "qwen3", num_hidden_layers=8)
    state_dict = AutoModelForCausalLM.from_pretrained(source).double().state_dict()
    embeddings = state_dict["model.embed_tokens.weight"]
    perturb(state_dict, "model.embed_tokens.weight", relative=1e-12)
    input_ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    config = AutoConfig.from_pretrained(source)
    perturbed = streamed_logits(config, lambda name, rows=None: state_dict[name][rows or slice(None)], input_ids)
    state_dict["model.embed_tokens.weight"] = embeddings
    exact = streamed_logits(config, lambda name, rows=None: state_dict[name][rows or slice(None)], input_ids)
    assert 0 < relative_difference(perturbed, exact) < 1e-3 * VERIFY_TOLERANCE


def test_deeper_exact_conversion_passes(tmp_path, monkeypatch, capsys):
    source = make_source(tmp_path / "source", "llama", num_hidden_layers=12, tokenizer=True)
    verification, out, error = convert_with(monkeypatch, capsys, tmp_path, source)
    assert error is None
    assert verification.difference <= VERIFY_TOLERANCE
    assert (
        f"verify: max |logits - source logits| / std(source logits) = {verification.difference:.3g} in float64, with "
        f"RoPE kept and the transforms at identity (limit {VERIFY_TOLERANCE:g})\n" in out
    )
    assert (
        f"verify: perplexity on the built-in text: source {verification.source_perplexity:.3f}, converted "
        f"{verification.converted_perplexity:.3f} (rope keep, init identity)\n" in out
    )


# id: (how the written checkpoint is wrong, where the outputs first differ)
WRONG = {
    "swapped-k-proj": (
        lambda t: swap(t, "model.layers.1.self_attn.k_proj.weight", "model.layers.2.self_attn.k_proj.weight"),
        "layer 1's output",
    ),
    "perturbed-down-proj": (lambda t: perturb(t, "model.layers.2.mlp.down_proj.weight"), "layer 2's output"),
    "perturbed-embeddings": (lambda t: perturb(t, "model.embed_tokens.weight"), "the input embeddings"),
    "perturbed-final-norm": (lambda t: perturb(t, "model.norm.weight"), "the final norm's output"),
    "perturbed-head": (lambda t: perturb(t, "lm_head.weight"), "the logits (the head)"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_wrong_tensor_fails(case, tmp_path, monkeypatch, capsys):
    """A misplaced tensor, or one perturbed by 1e-3 of its scale, fails with one line naming where it shows first."""
    edit, first = WRONG[case]
    source = make_source(tmp_path / "source", "llama", num_hidden_layers=4)
    verification, _, error = convert_with(monkeypatch, capsys, tmp_path, source, edit)
    assert error == failure_message(verification)
    assert verification.difference > VERIFY_TOLERANCE and verification.first_differing == first


def test_tolerance_is_relative_to_the_logits_scale(tmp_path, monkeypatch, capsys):
    """Scaling every logit (through the final norm's weight, by powers of 2: exact) leaves the measured difference of
    a perturbed conversion unchanged, so a model with small logits fails as one with large logits does."""
    differences = []
    for scale in (2.0**-12, 1.0, 2.0**12):
        source = make_source(tmp_path / f"source-{scale}", "llama")
        edit_checkpoint(source, lambda t, scale=scale: t["model.norm.weight"].mul_(scale))
        verification, _, error = convert_with(
            monkeypatch,
            capsys,
            tmp_path / str(scale),
            source,
            lambda t: perturb(t, "model.layers.1.mlp.up_proj.weight"),
        )
        assert error == failure_message(verification)
        differences.append(verification.difference)
    assert differences[0] == differences[1] == differences[2]
