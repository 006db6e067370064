"""`path-hf convert --local-window / --local-sinks`: the layers outside `--layers` become local. The plan names them,
the config holds the fields, `--verify` passes on the tokens inside the window (where a local layer is the source's),
the converted model past the window is transformers' Mistral with the same sliding window, a recipe's
`model.convert` takes the same keys, and bad values are refused before anything is written."""

import argparse
import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from path_hf.arguments import add_arguments, from_arguments
from path_hf.conversion.options import VERIFY_TOLERANCE, ConvertOptions
from path_hf.errors import RecipeError
from path_hf.evaluation import rope_parameters_for, rope_scaling
from path_hf.recipes.models import conversion_options, convert_flags
from path_hf.recipes.settings import ModelSettings
from tests.conversion.checkpoints import convert_in_process, make_source, run_cli
from tests.evaluation.test_local_layers import script


@pytest.mark.parametrize(("window", "tokens"), [(16, 16), (1000, 256)])
def test_convert_and_verify_local_layers(window, tokens, tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama", tokenizer=True)
    output = tmp_path / "converted"
    flags = ["--layers", "1", "--local-window", str(window), "--local-sinks", "2", "--init", "identity", "--verify"]
    conversion, out = convert_in_process(capsys, "--from", source, "--to", output, "--rope", "keep", *flags)
    assert (
        f"local layers: 0,2, RoPE attention to the last {window} tokens and 2 sink(s) renumbered into the window\n"
        in out
    )
    assert f"verify: running the source and the converted model on {min(tokens, 256)} tokens" in out
    assert ("the local layers' window (--local-window)" in out) == (window < 256)
    assert conversion.verification.tokens == min(tokens, 256)
    assert conversion.verification.difference <= VERIFY_TOLERANCE
    assert f"std(source logits) = {conversion.verification.difference:.3g} in float64" in out
    saved = json.loads((output / "config.json").read_text())
    assert (saved["local_window"], saved["local_sinks"], saved["path_layers"]) == (window, 2, [1])
    assert saved["path_conversion"]["options"]["local_window"] == window
    assert (output / "local_attention.py").is_file()  # the code of the local layers, for trust_remote_code


def test_converted_local_layers_are_mistral_sliding_window(tmp_path, capsys):
    """Every layer local (`--layers` empty of the model's layers is not allowed: one PaTH layer at identity with RoPE
    kept is the source's layer): on 60 tokens with a window of 16 the converted model is Mistral's sliding window on
    its local layers, checked on the one-layer-local, two-layers-RoPE model against a window that covers layer 1."""
    source = make_source(tmp_path / "source", "llama", num_hidden_layers=2)
    output = tmp_path / "converted"
    flags = ["--layers", "1", "--local-window", "16", "--rope", "keep", "--init", "identity"]
    assert run_cli(capsys, "convert", "--from", source, "--to", output, *flags)[0] == 0
    converted = AutoModelForCausalLM.from_pretrained(output).eval()
    reference = AutoModelForCausalLM.from_pretrained(source).eval()
    config = MistralConfig(**{**reference.config.to_dict(), "model_type": "mistral", "sliding_window": 16})
    mistral = MistralForCausalLM(config).eval()
    mistral.load_state_dict(reference.state_dict())
    mistral.set_attn_implementation("eager")
    input_ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = {}
        converted.model.layers[0].register_forward_hook(lambda m, a, o: hidden.__setitem__("path", o))
        mistral.model.layers[0].register_forward_hook(lambda m, a, o: hidden.__setitem__("mistral", o))
        reference.model.layers[0].register_forward_hook(lambda m, a, o: hidden.__setitem__("source", o))
        converted(input_ids), mistral(input_ids), reference(input_ids)
    torch.testing.assert_close(hidden["path"], hidden["mistral"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(hidden["path"][:, 16:], hidden["source"][:, 16:], atol=1e-4)


def test_recipe_takes_the_same_keys(tmp_path):
    model_args = ModelSettings(path="SRC", convert={"layers": "3,7", "local_window": 8192, "local_sinks": 4})
    options = conversion_options(model_args, str(tmp_path / "out"))
    assert (options.layers, options.local_window, options.local_sinks) == ((3, 7), 8192, 4)
    with pytest.raises(RecipeError, match="model.convert: --local-sinks are the sinks of the local layers"):
        conversion_options(ModelSettings(path="SRC", convert={"local_sinks": 4}), str(tmp_path / "out"))


REFUSED = {
    "window-without-layers": (["--local-window", "16"], "name the PaTH layers with --layers"),
    "zero-window": (["--layers", "1", "--local-window", "0"], "--local-window must be a positive number of tokens"),
    "sinks-without-window": (["--local-sinks", "4"], "--local-sinks are the sinks of the local layers"),
    "negative-sinks": (["--layers", "1", "--local-window", "8", "--local-sinks", "-1"], "got -1."),
    "every-layer-path": (["--layers", "0-2", "--local-window", "8"], "every layer is a PaTH layer"),
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
    assert sorted(path.name for path in tmp_path.iterdir()) == ["source"]


@pytest.mark.parametrize("window", [16, 64])
def test_rope_scaling_rescales_the_global_layers_only(window, tmp_path, capsys):
    """YaRN on a hybrid (`path-hf eval --model PATH@yarn:F`) rescales the RoPE of its PaTH layers and leaves the local
    layers' alone while the window is within the training context: the identity-initialised hybrid under
    `rope_scaling` is the source under `lab/smollm2/local_layers.py`'s hooks (renumbered sinks, YaRN's cos / sin
    on the global layer, both computed independently). A window past the training context is rescaled too."""
    source = make_source(tmp_path / "source", "llama", max_position_embeddings=32)
    output = tmp_path / "converted"
    flags = ["--layers", "1", "--local-window", str(window), "--local-sinks", "2", "--rope", "keep"]
    flags += ["--init", "identity"]
    assert run_cli(capsys, "convert", "--from", source, "--to", output, *flags)[0] == 0
    converted = AutoModelForCausalLM.from_pretrained(output).eval()
    reference = AutoModelForCausalLM.from_pretrained(source).eval()
    input_ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(1))
    local_yarn = window > 32
    with torch.no_grad():
        with rope_scaling(converted, "yarn", 2.0):
            assert (converted.model.local_rotary_emb.rope_type == "yarn") == local_yarn
            got = converted(input_ids).logits
        assert converted.model.local_rotary_emb.rope_type == converted.model.rotary_emb.rope_type == "default"
        # the script's hooks put YaRN on the global layers; a rescaled local layer is built here the same way
        config = type(reference.config).from_dict(reference.config.to_dict())
        config.rope_parameters = rope_parameters_for(config, "yarn", 2.0)
        yarn_rope = type(reference.model.rotary_emb)(config)(torch.zeros(1), torch.arange(60)[None])
        script.hybrid(reference, 60, window, sinks=2, globals_=[1], yarn=2.0, renumber_sinks=True)
        if local_yarn:
            for index in (0, 2):
                reference.model.layers[index].register_forward_pre_hook(
                    lambda module, args, kwargs: (args, {**kwargs, "position_embeddings": yarn_rope}),
                    with_kwargs=True,
                )
        expected = reference(input_ids).logits
        with rope_scaling(reference, "yarn", 2.0):  # every layer's RoPE rescaled: another model
            every = reference(input_ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert local_yarn or not torch.allclose(got, every, atol=1e-4)


def test_shipped_recipes_convert_flags_are_the_recipes_options():
    """`make smollm2` and lab/gpu/run.sh convert with `path-hf convert` and the flags of the recipe's `model.convert`:
    parsed by the converter, they give the options the recipe itself would convert with (the hybrid's keys included)."""
    root = Path(__file__).resolve().parents[2]
    hybrids = {"smollm2-135m-cpu.yaml": ((7, 14, 17, 18, 20, 21, 23), 2048, 4)}
    hybrids["smollm2-135m-gpu.yaml"] = ((3, 7, 11, 15, 19, 23, 27), 8192, 4)
    for name, hybrid in hybrids.items():
        recipe = yaml.safe_load((root / "recipes" / "configs" / name).read_text())
        parser = argparse.ArgumentParser()
        add_arguments(parser, ConvertOptions)
        flags = convert_flags(recipe["model"]["convert"])
        parsed = from_arguments(parser.parse_args(["--from", "SRC", "--to", "OUT", *flags]), ConvertOptions)
        expected = conversion_options(ModelSettings(path="SRC", convert=recipe["model"]["convert"]), "OUT")
        assert parsed == expected
        assert (parsed.layers, parsed.local_window, parsed.local_sinks) == hybrid
    with pytest.raises(RecipeError, match="unknown key model.convert.window"):
        convert_flags({"window": 8192})
