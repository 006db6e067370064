"""`path_hf.evaluation.attention_mass`: the decode-step attention rows of PaTH layers (against PaTH attention written
from the definition, with explicit Householder matrices) and of RoPE layers (against eager attention's full matrix),
the masses summed from them, a model that computes the same whether or not the weights are asked for, and
`examples/smollm2/attention_mass.py` on tiny checkpoints."""

import importlib.util
import json

import pytest
import torch
from transformers import LlamaForCausalLM, StaticCache

from path_hf import PaTHLlamaForCausalLM, modeling_path_llama
from path_hf.evaluation import attention_mass, decode_attention_rows, read_texts, rope_scaling, tokenize_stream
from path_hf.modeling_path_llama import PaTHLlamaAttention
from tests.evaluation.eval_models import EVAL_DATA, ROOT
from tests.ops.path_reference import path_scores_reference
from tests.tiny import tiny_config

_spec = importlib.util.spec_from_file_location(
    "smollm2_attention_mass", ROOT / "examples" / "smollm2" / "attention_mass.py"
)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)

VOCAB, LENGTH, QUERIES, FAR = 101, 24, 4, 5
# The tiny models' fields beyond `tests.tiny.SHAPES` (GQA: two query heads read each key head).
FIELDS = dict(
    vocab_size=VOCAB,
    max_position_embeddings=16,
    initializer_range=0.2,  # peaked attention, so that a wrong row shows
)
# (rope_mode, forget gate, path_layers): every PaTH layer, or layer 1 only (layer 0 keeps RoPE attention).
PATH_MODELS = [
    ("drop", False, None),
    ("drop", True, None),
    ("interleave", False, None),
    ("interleave", True, None),
    ("interleave", True, [1]),
]


def path_model(rope_mode: str, forget_gate: bool, path_layers: list[int] | None, seed: int = 0) -> PaTHLlamaForCausalLM:
    torch.manual_seed(seed)
    config = tiny_config(
        "path",
        **FIELDS,
        rope_mode=rope_mode,
        path_forget_gate=forget_gate,
        path_forget_gate_bias=2.0,  # forgets slowly: far keys keep some mass
        path_layers=path_layers,
        path_backend="torch",
    )
    return PaTHLlamaForCausalLM(config).eval()


def llama_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config("llama", **FIELDS)).eval()


def tokens(batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, LENGTH), generator=torch.Generator().manual_seed(seed))


def reference_probabilities(model, input_ids: torch.Tensor, monkeypatch) -> list[torch.Tensor]:
    """Every layer's full attention matrix `[B, heads, T, T]` over the whole sequence, from one forward without a
    cache: PaTH layers from their q, k, w, beta, g (as the layers hand them to `path_attention`, one call a layer in
    order) through explicit Householder matrices (`path_scores_reference`), RoPE layers from eager attention."""
    captured = []
    original = modeling_path_llama.path_attention

    def capture(q, k, v, w, beta, g=None, **kwargs):
        captured.append((q, k, w, beta, g))
        return original(q, k, v, w, beta, g, **kwargs)

    monkeypatch.setattr(modeling_path_llama, "path_attention", capture)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = list(model(input_ids, use_cache=False, output_attentions=True).attentions)
    model.set_attn_implementation("sdpa")
    monkeypatch.undo()
    path_layers = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.self_attn, PaTHLlamaAttention)]
    assert len(captured) == len(path_layers)
    assert all(q.shape[:2] == input_ids.shape for q, *_ in captured)  # the [B, T] rows, not flattened
    inputs = dict(zip(path_layers, captured, strict=True))
    probabilities = []
    for index, layer in enumerate(model.model.layers):
        if index not in inputs:
            probabilities.append(eager.pop(0).double())
            continue
        q, k, w, beta, g = (x.double() if x is not None else None for x in inputs[index])
        logits, _ = path_scores_reference(q, k, w, beta)
        if g is not None:  # FLA's forget gate: G_i - G_j inside the softmax scale
            gate = g.cumsum(1).transpose(1, 2)
            logits = logits + gate[..., :, None] - gate[..., None, :]
        probabilities.append((layer.self_attn.scaling * logits).softmax(-1))
    assert not eager  # every RoPE layer's matrix was used
    return probabilities


def assert_rows_match(model, input_ids: torch.Tensor, monkeypatch) -> None:
    reference = reference_probabilities(model, input_ids, monkeypatch)
    steps = list(decode_attention_rows(model, input_ids, QUERIES))
    assert [position for position, _ in steps] == list(range(LENGTH - QUERIES, LENGTH))
    for position, rows in steps:
        assert len(rows) == len(reference)
        for layer, (row, full) in enumerate(zip(rows, reference, strict=True)):
            assert row.shape == (input_ids.shape[0], full.shape[1], 1, position + 1), (layer, position)
            expected = full[:, :, position, : position + 1]
            torch.testing.assert_close(row[:, :, 0].double(), expected, rtol=0, atol=1e-5, msg=f"{layer=} {position=}")
    assert model.config._attn_implementation == "sdpa" and not model.training  # restored


@pytest.mark.parametrize(("rope_mode", "forget_gate", "path_layers"), PATH_MODELS)
def test_path_decode_rows_match_householder_reference(rope_mode, forget_gate, path_layers, monkeypatch):
    model = path_model(rope_mode, forget_gate, path_layers)
    assert_rows_match(model, tokens(batch=2), monkeypatch)


def test_llama_decode_rows_match_eager_full_matrix(monkeypatch):
    assert_rows_match(llama_model(), tokens(batch=2), monkeypatch)


def test_static_cache_rows_match_dynamic_cache():
    """A static cache's decode step returns a row over all its slots: the dynamic cache's row, then zeros."""
    model, input_ids = path_model("interleave", True, None), tokens()
    rows = dict(decode_attention_rows(model, input_ids, QUERIES))
    cache = StaticCache(config=model.config, max_cache_len=LENGTH + 8)
    with torch.no_grad():
        model(input_ids[:, : LENGTH - QUERIES], cache=cache, use_cache=True)
        for position in range(LENGTH - QUERIES, LENGTH):
            output = model(input_ids[:, position : position + 1], cache=cache, use_cache=True, output_attentions=True)
            for static, dynamic in zip(output.attentions, rows[position], strict=True):
                assert static.shape[-1] == LENGTH + 8
                torch.testing.assert_close(static[..., : position + 1], dynamic, rtol=0, atol=1e-6)
                assert not static[..., position + 1 :].any()


@pytest.mark.parametrize("name", ["path", "path-mixed", "llama"])
def test_masses_sum_the_reference_rows(name, monkeypatch):
    model = {
        "path": lambda: path_model("drop", True, None),
        "path-mixed": lambda: path_model("interleave", True, [1]),
        "llama": llama_model,
    }[name]()
    input_ids = tokens(batch=2, seed=1)
    reference = reference_probabilities(model, input_ids, monkeypatch)
    result = attention_mass(model, input_ids, far=FAR, queries=QUERIES)
    assert (result["length"], result["far"], result["queries"], result["batch"]) == (LENGTH, FAR, QUERIES, 2)
    types = model.config.layer_types if name != "llama" else [None, None]  # LlamaConfig names no layer types
    assert [entry["type"] for entry in result["layers"]] == types
    positions = range(LENGTH - QUERIES, LENGTH)
    for entry, full in zip(result["layers"], reference, strict=True):
        rows = torch.stack([full[:, :, i] for i in positions])  # [Q, B, heads, T]
        sink = rows[..., 0].mean((0, 1))
        # keys 0 < j < i - F; with the sink, every key up to i - F - 1
        far = torch.stack([full[:, :, i, 1 : i - FAR].sum(-1) for i in positions]).mean((0, 1))
        up_to_far = torch.stack([full[:, :, i, : i - FAR].sum(-1) for i in positions]).mean((0, 1))
        assert entry["heads"] == 4
        per_head = {key: torch.tensor(entry[f"{key}_mass_per_head"], dtype=torch.float64) for key in ("sink", "far")}
        torch.testing.assert_close(per_head["sink"], sink, rtol=0, atol=1e-5)
        torch.testing.assert_close(per_head["far"], far, rtol=0, atol=1e-5)
        torch.testing.assert_close(per_head["sink"] + per_head["far"], up_to_far, rtol=0, atol=1e-5)
        assert far.min() > 1e-3  # the far keys do hold mass in these models: the test tests something
        assert entry["sink_mass"] == pytest.approx(sink.mean().item(), abs=1e-5)
        assert entry["far_mass"] == pytest.approx(far.mean().item(), abs=1e-5)
    layers = result["layers"]
    assert result["sink_mass"] == pytest.approx(sum(entry["sink_mass"] for entry in layers) / len(layers))
    assert result["far_mass"] == pytest.approx(sum(entry["far_mass"] for entry in layers) / len(layers))


def test_no_far_key_in_a_short_window():
    model, input_ids = llama_model(), tokens()
    result = attention_mass(model, input_ids, far=LENGTH - 2, queries=QUERIES)  # i - j > T - 2 only for i = T-1, j = 0
    assert all(mass == 0.0 for entry in result["layers"] for mass in entry["far_mass_per_head"])
    assert result["far_mass"] == 0.0 and result["sink_mass"] > 0


@pytest.mark.parametrize("queries", [0, LENGTH])
def test_queries_out_of_range_are_refused(queries):
    with pytest.raises(ValueError, match="queries must be at least 1"):
        decode_attention_rows(llama_model(), tokens(), queries)


def test_weights_change_nothing_the_model_computes():
    """Logits of decode steps and of generate are the same, bit for bit, with and without the weights asked for; and
    the PaTH layers did return them."""
    model, input_ids = path_model("interleave", True, None), tokens()
    prefix = LENGTH - QUERIES

    def decode(output_attentions: bool) -> list[torch.Tensor]:
        with torch.no_grad():
            cache = model(input_ids[:, :prefix], use_cache=True).cache
            logits = []
            for position in range(prefix, LENGTH):
                output = model(
                    input_ids[:, position : position + 1],
                    cache=cache,
                    use_cache=True,
                    output_attentions=output_attentions,
                )
                assert (output.attentions is not None) == output_attentions
                if output_attentions:
                    assert len(output.attentions) == 2 and output.attentions[0].shape == (1, 4, 1, position + 1)
                logits.append(output.logits)
        return logits

    for with_weights, without in zip(decode(True), decode(False), strict=True):
        assert torch.equal(with_weights, without)

    def generate(output_attentions: bool):
        return model.generate(
            input_ids[:, :prefix],
            max_new_tokens=QUERIES,
            do_sample=False,
            output_attentions=output_attentions,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )

    with_weights, without = generate(True), generate(False)
    assert torch.equal(with_weights.sequences, without.sequences)
    for a, b in zip(with_weights.logits, without.logits, strict=True):
        assert torch.equal(a, b)
    decode_steps = with_weights.attentions[1:]  # the first entry is the prefill's: PaTH forms no matrix there
    assert decode_steps and all(
        len(step) == 2 and step[0].shape[-1] == prefix + index + 1 for index, step in enumerate(decode_steps)
    )


def test_script_writes_the_masses(checkpoints, tokenizer, tmp_path, capsys):
    output = tmp_path / "mass.json"
    argv = ["--model", f"source={checkpoints['llama']}", "--model", f"PaTH={checkpoints['path']}"]
    argv += ["--data", str(EVAL_DATA), "--length", "64", "--far", "16", "--queries", "4", "--output", str(output)]
    assert script.main(argv) == 0
    report = json.loads(output.read_text())
    assert report["data"] == ["examples/default_model/data/eval.jsonl.xz"]  # relative to the repository
    assert (report["length"], report["far"], report["queries"], report["dtype"]) == (64, 16, 4, "float32")
    assert [model["label"] for model in report["models"]] == ["source", "PaTH"]
    assert report["models"][1]["path"] == str(checkpoints["path"].resolve())  # outside the repository: absolute
    stream = torch.tensor([tokenize_stream(read_texts([EVAL_DATA]), tokenizer, max_tokens=64)])
    for entry, name in zip(report["models"], ["llama", "path"], strict=True):
        model = (LlamaForCausalLM if name == "llama" else PaTHLlamaForCausalLM).from_pretrained(checkpoints[name])
        expected = attention_mass(model, stream, far=16, queries=4)
        assert entry["sink_mass"] == pytest.approx(expected["sink_mass"], abs=1e-6)
        assert entry["far_mass"] == pytest.approx(expected["far_mass"], abs=1e-6)
        assert len(entry["layers"]) == 2 and entry["layers"][0]["far_mass_per_head"] == pytest.approx(
            expected["layers"][0]["far_mass_per_head"], abs=1e-6
        )
    table = capsys.readouterr().out
    assert "| source | 2 |" in table and "| PaTH | 2 |" in table


def test_script_refuses_a_short_text(checkpoints, tmp_path, capsys):
    data = tmp_path / "short.txt"
    data.write_text("Too short a text for the window.\n")
    argv = ["--model", str(checkpoints["llama"]), "--data", str(data), "--length", "64", "--far", "16"]
    assert script.main([*argv, "--queries", "4", "--output", str(tmp_path / "mass.json")]) == 1
    assert "fewer than --length 64" in capsys.readouterr().err
    assert not (tmp_path / "mass.json").exists()


def test_script_measures_a_rope_scaling(checkpoints, tokenizer, tmp_path):
    """`PATH@yarn:4` is measured with transformers' YaRN swapped in, as path-hf eval does it, and differs from the
    unscaled model."""
    output = tmp_path / "mass.json"
    argv = ["--model", f"plain={checkpoints['llama']}", "--model", f"yarn={checkpoints['llama']}@yarn:4"]
    argv += ["--data", str(EVAL_DATA), "--length", "64", "--far", "16", "--queries", "4", "--output", str(output)]
    assert script.main(argv) == 0
    plain, yarn = json.loads(output.read_text())["models"]
    assert (plain["rope_scaling"], yarn["rope_scaling"]) == (None, "yarn")
    stream = torch.tensor([tokenize_stream(read_texts([EVAL_DATA]), tokenizer, max_tokens=64)])
    model = LlamaForCausalLM.from_pretrained(checkpoints["llama"])
    with rope_scaling(model, "yarn", 4.0):
        expected = attention_mass(model, stream, far=16, queries=4)
    assert yarn["far_mass"] == pytest.approx(expected["far_mass"], abs=1e-6)
    assert yarn["far_mass"] != pytest.approx(plain["far_mass"], abs=1e-6)
