"""lab/smollm2/retrieval_layers.py: its rows are the source with some layers local (the `all` row is the plain
model, as `answer_scores` scores it), and `--heads` writes the library's needle mass prompt by prompt."""

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from lab.smollm2 import retrieval_layers as script
from path_hf.evaluation import answer_scores, needle_mass, needle_span, passkey_windows


def test_rows_name_their_global_layers_and_bad_rows_are_refused():
    rows = script.expand(["all", "none", "every4", "only:1-2", "without:0", "layers:5+1"], 8)
    assert rows == {
        "all": list(range(8)),
        "none": [],
        "every4": [3, 7],
        "only:1": [1],
        "only:2": [2],
        "without:0": list(range(1, 8)),
        "layers:5+1": [1, 5],
    }
    with pytest.raises(SystemExit, match="unknown row 'some'"):
        script.expand(["some"], 8)
    with pytest.raises(SystemExit, match="the model has layers 0 to 7"):
        script.expand(["only:8"], 8)


def test_the_all_row_is_the_model_and_local_rows_change_it(checkpoints, tokenizer, tmp_path):
    output = tmp_path / "rows.json"
    script.main([
        "--model", str(checkpoints["llama"]), "--length", "160", "--window", "16", "--depths", "0.2,0.8",
        "--trials", "2", "--rows", "all", "none", "--output", str(output),
    ])  # fmt: skip
    rows = json.loads(output.read_text())["rows"]
    model = LlamaForCausalLM.from_pretrained(checkpoints["llama"]).eval()
    windows = passkey_windows(tokenizer, 160, 2, depths=(0.2, 0.8))
    expected = answer_scores(model, windows, batch_size=1)
    for index, key in enumerate(("trial0@0.2", "trial0@0.8", "trial1@0.2", "trial1@0.8")):
        assert abs(rows["all"]["nll"][key] - expected.nll_sum[index] / expected.tokens[index]) < 1e-3
        assert rows["all"]["found"][key] == expected.all_correct[index]
        assert abs(rows["none"]["nll"][key] - rows["all"]["nll"][key]) > 1e-3  # a 16-token window changes it
    with pytest.raises(SystemExit, match="holds another protocol"):
        script.main([
            "--model", str(checkpoints["llama"]), "--length", "160", "--window", "32", "--depths", "0.2,0.8",
            "--trials", "2", "--rows", "all", "--output", str(output),
        ])  # fmt: skip


def test_heads_writes_each_prompts_needle_mass(checkpoints, tokenizer, tmp_path):
    output = tmp_path / "heads.json"
    script.main([
        "--model", str(checkpoints["llama"]), "--length", "160", "--depths", "0.3", "--trials", "2", "--heads",
        "--output", str(output),
    ])  # fmt: skip
    prompts = json.loads(output.read_text())["prompts"]
    model = LlamaForCausalLM.from_pretrained(checkpoints["llama"]).eval()
    windows = passkey_windows(tokenizer, 160, 2, depths=(0.3,))
    for name, window in zip(("trial0@0.3", "trial1@0.3"), windows, strict=True):
        expected = needle_mass(model, window, needle_span(tokenizer, window))
        torch.testing.assert_close(torch.tensor(prompts[name]["needle_mass"], dtype=torch.float64), expected,
                                   atol=1e-4, rtol=0)  # fmt: skip
