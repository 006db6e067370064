"""`path-hf convert --rope-max-wavelength` (critical-band RoPE) and `--attn-temperature-scale / -length` (Llama 4's
query temperature): the plan names the pairs that stop rotating, `context` is the source's training context, the
config holds the fields, `--verify` compares with the source changed by hand (transformers' model, its slow RoPE
frequencies zeroed, its queries scaled in hooks) and fails when the converted model does not do the same, and bad
values are refused before anything is written."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import path_hf.modeling_path_llama
from path_hf.conversion.options import VERIFY_TOLERANCE, ConvertOptions
from path_hf.conversion.plan import plan_conversion
from path_hf.conversion.verify import VerificationFailed
from path_hf.errors import RecipeError
from path_hf.recipes.models import conversion_options
from path_hf.recipes.settings import ModelSettings
from tests.conversion import test_convert_models
from tests.conversion.checkpoints import convert_in_process, make_source, run_cli
from tests.conversion.gguf_files import tiny_model, write_gguf

# The tiny sources' head dim is 16 (8 pairs), rope_theta 1e4: wavelengths 2 pi 10^(i/2) = 6.3, 20, 63, 199, 628, 1987,
# 6283, 19869 tokens; max_position_embeddings 256, so `context` keeps pairs 0-3.
LLAMA3_ROPE = {**test_convert_models.LLAMA3_ROPE, "original_max_position_embeddings": 64}
DIFFERENCE = (
    "verify: max |logits - reference logits| / std(reference logits) = {:.3g} in float64, with RoPE kept and the "
    f"transforms at identity (limit {VERIFY_TOLERANCE:g})\n"
)
EXACT = ["--init", "identity", "--verify"]
# id: (architecture, how the source is made, convert flags, the plan's band line, how verify names the reference)
CASES = {
    "llama-keep-context": (
        "llama",
        {"tokenizer": True},
        ["--rope", "keep", "--rope-max-wavelength", "context", *EXACT],
        "RoPE band:    pairs 0-3 rotate (wavelength <= 256 tokens, the source's context), pairs 4-7 do not",
        "the source with RoPE pairs 4-7 removed (inv_freq set to 0 where 2 pi / inv_freq > 256 tokens)",
    ),
    "llama-interleave-context": (
        "llama",
        {},
        ["--rope", "interleave", "--rope-max-wavelength", "context", *EXACT],
        "RoPE band:    pairs 0-3 rotate (wavelength <= 256 tokens, the source's context), pairs 4-7 do not",
        "the source with RoPE pairs 4-7 removed (inv_freq set to 0 where 2 pi / inv_freq > 256 tokens)",
    ),
    # Llama 3's scaled frequencies: the limit is against the model's own (pair 2, 167 tokens unscaled, has 1337).
    "llama3-rope-keep": (
        "llama",
        {"rope_parameters": LLAMA3_ROPE},
        ["--rope", "keep", "--rope-max-wavelength", "200", *EXACT],
        "RoPE band:    pairs 0-1 rotate (wavelength <= 200 tokens), pairs 2-7 do not",
        "the source with RoPE pairs 2-7 removed (inv_freq set to 0 where 2 pi / inv_freq > 200 tokens)",
    ),
    # Qwen3's q_norm: the temperature scales the normalised queries; the RoPE layer 1 keeps every pair.
    "qwen3-some-layers-band-temperature": (
        "qwen3",
        {"head_dim": 32},
        ["--rope", "interleave", "--layers", "0,2", "--rope-max-wavelength", "50"]
        + ["--attn-temperature-scale", "0.3", "--attn-temperature-length", "16", *EXACT],
        "RoPE band:    pairs 0-3 rotate (wavelength <= 50 tokens), pairs 4-15 do not",
        "the source with RoPE pairs 4-15 removed (inv_freq set to 0 where 2 pi / inv_freq > 50 tokens) and queries "
        "times Llama 4's temperature 1 + 0.3 log(floor((p + 1) / 16) + 1) (forward hooks; 1 to 1.483 on these 64 "
        "tokens) on its layers 0,2 (the PaTH layers)",
    ),
    # FLA's random init and RoPE dropped: verify checks at identity with RoPE kept, then runs the model as it is.
    "llama-drop-temperature-default-init": (
        "llama",
        {"tokenizer": True},
        ["--attn-temperature-scale", "0.5", "--attn-temperature-length", "8", "--verify"],
        None,
        "the source with queries times Llama 4's temperature 1 + 0.5 log(floor((p + 1) / 8) + 1) (forward hooks; "
        "1 to 2.748 on these 256 tokens)",
    ),
}


def zero_slow_pairs(model, max_wavelength: float) -> None:
    """transformers' model with the RoPE pairs of wavelength above `max_wavelength` at frequency 0."""
    rotary = model.model.rotary_emb
    rotary.inv_freq[2 * math.pi / rotary.inv_freq.double() > max_wavelength] = 0.0


@pytest.mark.parametrize("case", list(CASES))
def test_convert_and_verify(case, tmp_path, capsys):
    kind, source_fields, flags, band, reference = CASES[case]
    source = make_source(tmp_path / "source", kind, **source_fields)
    output = tmp_path / "converted"
    conversion, out = convert_in_process(capsys, "--from", source, "--to", output, *flags)
    verification = conversion.verification
    if band is not None:
        assert band + "\n" in out
    assert f"verify: reference: {reference}\n" in out
    assert verification.reference == reference
    assert verification.difference <= VERIFY_TOLERANCE
    assert DIFFERENCE.format(verification.difference) in out
    if source_fields.get("tokenizer"):
        assert (
            f"verify: perplexity on the built-in text: source {verification.source_perplexity:.3f}, reference "
            f"{verification.reference_perplexity:.3f}, converted {verification.converted_perplexity:.3f}" in out
        )

    saved = json.loads((output / "config.json").read_text())
    given = dict(zip(flags[::2], flags[1::2], strict=False))
    if "--rope-max-wavelength" in given:
        expected = 256.0 if given["--rope-max-wavelength"] == "context" else float(given["--rope-max-wavelength"])
        assert saved["rope_max_wavelength"] == expected
        # the record keeps what was asked for
        assert saved["path_conversion"]["options"]["rope_max_wavelength"] == (
            "context" if given["--rope-max-wavelength"] == "context" else expected
        )
    else:
        assert saved["rope_max_wavelength"] is None
    assert saved["path_attn_temperature_scale"] == float(given.get("--attn-temperature-scale", 0))
    assert saved["path_attn_temperature_length"] == (
        int(given["--attn-temperature-length"]) if "--attn-temperature-length" in given else None
    )


def test_converted_model_is_the_source_without_its_slow_pairs(tmp_path, capsys):
    """Checked here apart from --verify: the converted model as loaded (identity init) computes transformers' source
    with the pairs above the source's context at frequency 0, and the model card says so."""
    source = make_source(tmp_path / "source", "llama")
    output = tmp_path / "converted"
    flags = ["--rope", "interleave", "--init", "identity", "--rope-max-wavelength", "context"]
    assert run_cli(capsys, "convert", "--from", source, "--to", output, *flags)[0] == 0
    source_model = AutoModelForCausalLM.from_pretrained(source).eval()
    with torch.no_grad():  # sharper attention than the 0.02 init gives, so that positions matter
        for layer in source_model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
    converted = AutoModelForCausalLM.from_pretrained(output).eval()
    converted.load_state_dict(source_model.state_dict(), strict=False)
    input_ids = torch.randint(0, 256, (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        unchanged = source_model(input_ids).logits
        zero_slow_pairs(source_model, 256)
        expected = source_model(input_ids).logits
        logits = converted(input_ids).logits
    tolerance = 1e-5 * expected.abs().max().item()
    assert (expected - unchanged).abs().max() > 100 * tolerance  # the band removes something
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=tolerance)
    assert (
        "RoPE pairs 4-7 removed (`rope_max_wavelength` 256: they do not rotate)" in (output / "README.md").read_text()
    )


def test_context_is_the_original_context_of_a_scaled_rope(tmp_path):
    """`context` is `original_max_position_embeddings` of the RoPE parameters when they have one (here 64, with
    max_position_embeddings 256)."""
    source = make_source(tmp_path / "source", "llama", rope_parameters=LLAMA3_ROPE)
    options = ConvertOptions(
        source=str(source), output=str(tmp_path / "out"), rope="keep", rope_max_wavelength="context", dry_run=True
    )
    plan = plan_conversion(options)
    assert plan.config.rope_max_wavelength == 64.0
    assert "wavelength <= 64 tokens, the source's context" in plan.describe()


def test_gguf_source(tmp_path, capsys):
    """A GGUF's context is its `context_length` (128 here: pairs 0-2 of 8 rotate); verify passes against it."""
    source = write_gguf(tmp_path / "model.gguf", tiny_model(), "llama", "F32", tokenizer=False)
    output = tmp_path / "converted"
    flags = ["--rope", "keep", "--rope-max-wavelength", "context", *EXACT]
    conversion, out = convert_in_process(capsys, "--from", source, "--to", output, *flags)
    assert "RoPE band:    pairs 0-2 rotate (wavelength <= 128 tokens, the source's context), pairs 3-7 do not\n" in out
    assert "verify: reference: the source with RoPE pairs 3-7 removed" in out
    assert conversion.verification.difference <= VERIFY_TOLERANCE
    assert DIFFERENCE.format(conversion.verification.difference) in out
    assert json.loads((output / "config.json").read_text())["rope_max_wavelength"] == 128.0


# id: (what breaks the converted model, flags, the reference's description in the message)
BROKEN = {
    "band-not-applied": (
        ("rope_band", lambda config: None),
        ["--rope-max-wavelength", "100"],
        "the source with RoPE pairs 3-7 removed (inv_freq set to 0 where 2 pi / inv_freq > 100 tokens)",
    ),
    "temperature-not-applied": (
        ("attention_temperature", lambda position_ids, *args: torch.ones(position_ids.shape)),
        ["--attn-temperature-scale", "0.5", "--attn-temperature-length", "4"],
        "the source with queries times Llama 4's temperature 1 + 0.5 log(floor((p + 1) / 4) + 1) (forward hooks; "
        "1 to 2.417 on these 64 tokens)",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_verify_fails_when_the_model_does_not_follow_the_reference(case, tmp_path, capsys, monkeypatch):
    """With the converted model's band (or temperature) switched off, verify compares it with the reference that
    has them and fails, with one line naming the reference, and nothing is written."""
    (name, replacement), flags, reference = BROKEN[case]
    source = make_source(tmp_path / "source", "llama")
    monkeypatch.setattr(path_hf.modeling_path_llama, name, replacement)
    output = tmp_path / "converted"
    with pytest.raises(VerificationFailed) as failed:
        convert_in_process(capsys, "--from", source, "--to", output, "--rope", "keep", *flags, *EXACT)
    verification = failed.value.result
    assert str(failed.value) == (
        f"verification failed: the converted model's logits differ from the reference's ({reference}) by "
        f"{verification.difference:.3g} x their std (limit {VERIFY_TOLERANCE:g}; float64, RoPE kept, transforms at "
        "identity), first at layer 0's output: the weight mapping is wrong, or the converted model does not apply its "
        "RoPE band or temperature as the reference does."
    )
    assert (verification.reference, verification.first_differing) == (reference, "layer 0's output")
    assert verification.difference > 100 * VERIFY_TOLERANCE
    assert not output.exists() and sorted(path.name for path in tmp_path.iterdir()) == ["source"]


# id: (flags, message)
REFUSED = {
    "band-with-drop": (
        ["--rope-max-wavelength", "8192"],
        "--rope-max-wavelength limits the RoPE that PaTH layers keep, but --rope drop removes it",
    ),
    "context-with-drop": (["--rope", "drop", "--rope-max-wavelength", "context"], "but --rope drop removes it"),
    "zero": (["--rope", "keep", "--rope-max-wavelength", "0"], "--rope-max-wavelength must be a positive number of "),
    "negative": (["--rope", "keep", "--rope-max-wavelength", "-5"], "must be a positive number of tokens, got -5."),
    "infinite": (["--rope", "keep", "--rope-max-wavelength", "inf"], "must be a positive number of tokens, got inf."),
    "not-a-number": (
        ["--rope", "interleave", "--rope-max-wavelength", "abc"],
        "--rope-max-wavelength must be a number of tokens or 'context' (the source's training context), got 'abc'.",
    ),
    "negative-temperature": (["--attn-temperature-scale", "-0.1"], "--attn-temperature-scale must be a number >= 0"),
    "zero-length": (
        ["--attn-temperature-scale", "0.1", "--attn-temperature-length", "0"],
        "--attn-temperature-length must be a positive number of tokens, got 0.",
    ),
    "length-without-scale": (["--attn-temperature-length", "16"], "it needs --attn-temperature-scale"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused(case, tmp_path, capsys):
    flags, message = REFUSED[case]
    source = make_source(tmp_path / "source", "llama")
    output = tmp_path / "converted"
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", output, *flags)
    assert code == 1
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["source"]  # no output, staging or lock


def test_recipe_model_convert_mapping():
    """`model.convert` goes through the same dataclass: a YAML number or `context`, and the same refusals."""
    options = conversion_options(ModelSettings(path="src", convert={"rope": "keep", "rope_max_wavelength": 8192}), "o")
    assert options.rope_max_wavelength == 8192.0
    convert = {"rope": "interleave", "rope_max_wavelength": "context", "attn_temperature_scale": 0.1}
    options = conversion_options(ModelSettings(path="src", convert=convert), "o")
    assert (options.rope_max_wavelength, options.attn_temperature_scale) == ("context", 0.1)
    with pytest.raises(RecipeError, match="model.convert: --rope-max-wavelength limits the RoPE"):
        conversion_options(ModelSettings(path="src", convert={"rope_max_wavelength": 8192}), "o")
    with pytest.raises(RecipeError, match="must be a number of tokens or 'context'.*got 'True'"):
        conversion_options(ModelSettings(path="src", convert={"rope": "keep", "rope_max_wavelength": True}), "o")
