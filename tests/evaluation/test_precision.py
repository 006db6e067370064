"""`examples/smollm2/precision.py`: the bfloat16-versus-float32 drift statistics, against the same statistics computed
here from the full logits of plain forward passes, on a tiny Llama and a tiny PaTHLlama (forget gate on)."""

import copy
import importlib.util
import json

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from path_hf import PaTHLlamaConfig, PaTHLlamaForCausalLM
from path_hf.evaluation import read_texts, tokenize_stream
from tests.evaluation.eval_models import EVAL_DATA, ROOT, shapes

_spec = importlib.util.spec_from_file_location("smollm2_precision", ROOT / "examples" / "smollm2" / "precision.py")
precision = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(precision)

LENGTH, WINDOWS = 24, 2


@pytest.fixture(scope="module")
def models(checkpoints, tokenizer, tmp_path_factory) -> dict:
    """{"llama": dir, "path": dir}: the tiny random Llama, and a tiny random PaTHLlama with the forget gate."""
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("precision") / "path-gate"
    config = PaTHLlamaConfig(**shapes(tokenizer), path_forget_gate=True, path_backend="torch")
    PaTHLlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {"llama": checkpoints["llama"], "path": path}


@pytest.fixture(scope="module")
def stream(tokenizer) -> list[int]:
    return tokenize_stream(read_texts([EVAL_DATA]), tokenizer, max_tokens=LENGTH * WINDOWS)


def direct_drift(reference: torch.Tensor, logits: torch.Tensor) -> dict:
    """The statistics from full `[positions, vocab]` logits, in float64."""
    r, t = reference.double(), logits.double()
    row_max = (t - r).abs().amax(-1)
    spread = r.std(-1, correction=0)
    log_p, log_q = r.log_softmax(-1), t.log_softmax(-1)
    return {
        "positions": r.shape[0],
        "max_abs_diff": row_max.max().item(),
        "mean_abs_diff": (t - r).abs().mean().item(),
        "spread": spread.mean().item(),
        "max_diff_over_spread": (row_max.max() / spread.mean()).item(),
        "mean_max_diff_over_spread": (row_max / spread).mean().item(),
        "top1_agreement": (r.argmax(-1) == t.argmax(-1)).double().mean().item(),
        "kl": (log_p.exp() * (log_p - log_q)).sum(-1).mean().item(),
        "entropy": -(log_p.exp() * log_p).sum(-1).mean().item(),
    }


def full_logits(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(input_ids=window[None], use_cache=False).logits[0].float() for window in windows])


def assert_matches(result: dict, expected: dict, rel: float = 1e-5) -> None:
    for name, value in expected.items():
        assert result[name] == pytest.approx(value, rel=rel, abs=1e-9), name


@pytest.mark.parametrize("name", ["llama", "path"])
def test_bfloat16_drift_matches_a_direct_computation(models, stream, name):
    # 7 positions per chunk: the logits are formed in pieces that cut the windows unevenly.
    result = precision.precision_drift(models[name], stream, LENGTH, WINDOWS, torch.bfloat16, positions_per_chunk=7)
    windows = torch.tensor(stream).view(WINDOWS, LENGTH)
    reference = full_logits(AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32), windows)
    logits = full_logits(AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.bfloat16), windows)
    expected = direct_drift(reference, logits)
    assert expected["max_abs_diff"] > 0  # bfloat16 does change the logits of these models
    assert_matches(result, expected)
    assert (result["model"], result["dtype"], result["reference_dtype"]) == (str(models[name]), "bfloat16", "float32")
    assert (result["length"], result["windows"], result["positions"]) == (LENGTH, WINDOWS, LENGTH * WINDOWS)


@pytest.mark.parametrize("name", ["llama", "path"])
def test_weights_only_rounds_the_weights_and_computes_in_float32(models, stream, name):
    result = precision.precision_drift(models[name], stream, LENGTH, WINDOWS, torch.bfloat16, weights_only=True)
    windows = torch.tensor(stream).view(WINDOWS, LENGTH)
    reference_model = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32)
    rounded = copy.deepcopy(reference_model)
    rounded.load_state_dict({key: value.bfloat16().float() for key, value in reference_model.state_dict().items()})
    expected = direct_drift(full_logits(reference_model, windows), full_logits(rounded, windows))
    assert expected["max_abs_diff"] > 0
    assert_matches(result, expected)
    assert result["weights_only"] is True and result["dtype"] == "bfloat16"
    # Computing in bfloat16 too moves the logits further than rounding the weights alone.
    full = precision.precision_drift(models[name], stream, LENGTH, WINDOWS, torch.bfloat16)
    assert full["weights_only"] is False and full["mean_abs_diff"] > result["mean_abs_diff"]


@pytest.mark.parametrize("name", ["llama", "path"])
def test_the_same_dtype_gives_no_drift(models, stream, name):
    result = precision.precision_drift(models[name], stream, LENGTH, WINDOWS, dtype=torch.float32)
    assert result["max_abs_diff"] == result["mean_abs_diff"] == result["mean_max_diff_over_spread"] == 0
    assert result["top1_agreement"] == 1
    assert result["kl"] == pytest.approx(0, abs=1e-12)
    assert result["spread"] > 0


@pytest.mark.parametrize("name", ["llama", "path"])
def test_swapped_output_rows_give_the_expected_drift(models, stream, name):
    """Swapping the lm_head rows of tokens a and b swaps their logits and nothing else: the largest difference is
    max |l_a - l_b|, the argmax changes exactly where it was a or b, and KL = (p_a - p_b)(l_a - l_b) per position."""
    reference = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32)
    windows = torch.tensor(stream).view(WINDOWS, LENGTH)
    logits = full_logits(reference, windows).double()
    a = int(logits.argmax(-1).mode().values)  # the most frequent prediction, so some positions change
    b = int(logits.mean(0).index_fill(0, torch.tensor(a), -torch.inf).argmax())  # the runner-up on average
    swapped = copy.deepcopy(reference)
    weight = reference.lm_head.weight.detach().clone()
    weight[[a, b]] = weight[[b, a]]
    swapped.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    swapped.lm_head.weight = nn.Parameter(weight)

    result = precision.logit_drift(reference, swapped, windows, positions_per_chunk=5)
    gap = logits[:, a] - logits[:, b]
    p = logits.softmax(-1)
    changed = (logits.argmax(-1) == a) | (logits.argmax(-1) == b)
    assert changed.any() and not changed.all()
    assert result["max_abs_diff"] == pytest.approx(gap.abs().max().item(), rel=1e-5)
    assert result["mean_abs_diff"] == pytest.approx(2 * gap.abs().mean().item() / logits.shape[1], rel=1e-4)
    assert result["top1_agreement"] == pytest.approx(1 - changed.double().mean().item())
    assert result["kl"] == pytest.approx(((p[:, a] - p[:, b]) * gap).mean().item(), rel=1e-4)


def test_windows_must_fit_the_text(stream):
    with pytest.raises(ValueError, match=f"need {LENGTH * 100} tokens, the text has {len(stream)}"):
        precision.token_windows(stream, LENGTH, 100)


def test_cli_prints_a_table_and_writes_json(models, tmp_path, capsys):
    out = tmp_path / "precision.json"
    args = [str(models["llama"]), str(models["path"]), "--length", "16", "--windows", "2", "--json", str(out)]
    assert precision.main(args) == 0
    results = json.loads(out.read_text())
    assert [(r["model"], r["length"], r["windows"]) for r in results] == [
        (str(models["llama"]), 16, 2),
        (str(models["path"]), 16, 2),
    ]
    rows = capsys.readouterr().out.splitlines()[-2:]
    assert rows[0].startswith(f"| {models['llama']} | 16 | ") and rows[1].startswith(f"| {models['path']} | 16 | ")


def test_cli_refuses_a_missing_model(tmp_path, capsys):
    assert precision.main([str(tmp_path / "missing"), "--length", "16"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "missing" in err[0]
