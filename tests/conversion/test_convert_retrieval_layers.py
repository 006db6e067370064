"""`path-hf convert --retrieval-layers N`: the PaTH layers are the N whose strongest head looks most at a passkey's
needle in the source (checked against eager attention, computed here), recorded in the config, also from a recipe's
`model.convert`; bad values are refused before anything runs or is written."""

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from path_hf.conversion.options import format_layers
from path_hf.errors import RecipeError
from path_hf.evaluation import passkey_windows
from path_hf.loading import load_causal_lm, load_tokenizer
from path_hf.recipes.models import conversion_options
from path_hf.recipes.settings import ModelSettings
from tests.conversion.checkpoints import make_source, run_cli
from tests.conversion.gguf_files import tiny_model, write_gguf
from tests.evaluation.eval_models import TOKENIZER, shapes
from tests.evaluation.test_retrieval_heads import eager_needle_mass

LENGTH = 160


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny random Llama of 5 layers (head dim 16) with the default model's tokenizer (passkey prompts need real
    words)."""
    directory = tmp_path_factory.mktemp("retrieval") / "source"
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(2)
    fields = {"hidden_size": 64, "num_hidden_layers": 5, "max_position_embeddings": 256}
    config = LlamaConfig(**{**shapes(tokenizer), **fields})
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def expected_layers(source, count: int) -> tuple[list[int], list[float]]:
    """The `count` layers of the largest head mass (the converter's 2 keys at depths 0.1 and 0.5), and every layer's."""
    model = LlamaForCausalLM.from_pretrained(source).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    windows = passkey_windows(tokenizer, LENGTH, 2, 0, (0.1, 0.5))
    strongest = torch.stack([eager_needle_mass(model, tokenizer, w) for w in windows]).mean(0).max(-1).values
    order = sorted(range(len(strongest)), key=lambda layer: -strongest[layer])
    assert strongest[order[count - 1]] - strongest[order[count]] > 1e-4  # the choice is not a tie
    return sorted(order[:count]), strongest.tolist()


def test_retrieval_layers_become_the_path_layers(source, tmp_path, capsys):
    output = tmp_path / "converted"
    flags = ["--retrieval-layers", "2", "--retrieval-length", LENGTH, "--local-window", "64", "--local-sinks", "2"]
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", output, *flags)
    assert code == 0, err
    chosen, strongest = expected_layers(source, 2)
    saved = json.loads((output / "config.json").read_text())
    assert saved["path_layers"] == chosen
    assert saved["path_conversion"]["options"]["retrieval_layers"] == 2
    assert saved["path_conversion"]["options"]["layers"] == chosen
    line = next(line for line in out.splitlines() if line.startswith("retrieval layers: "))
    assert line.startswith(f"retrieval layers: {format_layers(chosen)} (")
    for layer, value in enumerate(strongest):
        assert f"{layer} {value:.2f}" in line
    assert f"local layers: {format_layers(i for i in range(5) if i not in chosen)}," in out


def test_a_recipe_takes_retrieval_layers(tmp_path):
    options = conversion_options(
        ModelSettings(path="SRC", convert={"retrieval_layers": 7, "retrieval_length": 4096, "local_window": 8192}),
        str(tmp_path / "out"),
    )
    assert (options.retrieval_layers, options.retrieval_length, options.layers) == (7, 4096, None)
    with pytest.raises(RecipeError, match="give one of the two"):
        conversion_options(ModelSettings(path="SRC", convert={"retrieval_layers": 7, "layers": "3"}), "out")


REFUSED = {
    "with-layers": (["--retrieval-layers", "2", "--layers", "1"], "give one of the two"),
    "zero": (["--retrieval-layers", "0"], "--retrieval-layers must be a positive number of layers, got 0."),
    "length-alone": (["--retrieval-length", "100"], "--retrieval-length is the prompts' length of --retrieval-layers"),
    "every-layer": (["--retrieval-layers", "5"], "asks for at least every layer of the model's 5"),
    "too-short": (["--retrieval-layers", "2", "--retrieval-length", "20"], "too short for a passkey prompt"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused(case, source, tmp_path, capsys):
    flags, message = REFUSED[case]
    output = tmp_path / "converted"
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", output, *flags)
    assert code == 1
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not output.exists() and not list(tmp_path.iterdir())


def test_a_source_the_converter_refuses_is_refused_before_it_runs(tmp_path, capsys):
    source = make_source(tmp_path / "source", "mistral", sliding_window=16)  # no tokenizer: it would fail later
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "out", "--retrieval-layers", "1")
    assert code == 1 and "sliding-window attention" in err, err
    assert "retrieval layers" not in out


def test_a_gguf_source_is_measured_from_the_file(tmp_path, capsys):
    """A GGUF runs as the model `path-hf eval` loads from it (dequantised, its own tokenizer), also with --dry-run,
    which writes no weights to load."""
    source = write_gguf(tmp_path / "model.gguf", tiny_model(num_hidden_layers=3, seed=4), "llama", "F32")
    flags = ["--retrieval-layers", "1", "--retrieval-length", LENGTH, "--dry-run"]
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "out", *flags)
    assert code == 0, err
    model = load_causal_lm(str(source), torch.float32).eval()
    tokenizer = load_tokenizer(str(source))
    windows = passkey_windows(tokenizer, LENGTH, 2, 0, (0.1, 0.5))
    strongest = torch.stack([eager_needle_mass(model, tokenizer, w) for w in windows]).mean(0).max(-1).values
    assert f"PaTH layers:  {int(strongest.argmax())} (1 of 3)" in out
    assert not (tmp_path / "out").exists()
