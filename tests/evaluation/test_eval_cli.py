"""`path-hf eval` against a direct computation, its outputs, and its refusals."""

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from path_hf.cli import main
from path_hf.evaluation import ModelSpec, parse_lengths, read_texts, tokenize_stream
from tests.evaluation.eval_models import EVAL_DATA, TRAIN_LENGTH

MAX_TOKENS = 160


def stream_of(tokenizer, max_tokens: int = MAX_TOKENS) -> list[int]:
    """The evaluation tokens, built here by hand: each document with its special tokens, then EOS, cut."""
    stream = []
    for text in read_texts([EVAL_DATA]):
        stream += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    return stream[:max_tokens]


def window_nll(model, ids: list[int]) -> float:
    """Sum of -log p(token t | tokens before it in the window), t >= 1, one forward pass."""
    ids = torch.tensor(ids)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].double()
    return -F.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).sum().item()


def direct_ppl(model, stream: list[int], length: int, stride: int | None = None) -> float:
    if stride is None:
        windows = [stream[begin : begin + length] for begin in range(0, len(stream), length)]
        nll = sum(window_nll(model, window) for window in windows if len(window) > 1)
        return math.exp(nll / sum(len(window) - 1 for window in windows))
    nll = 0.0
    for t in range(1, len(stream)):  # token t, read with the longest context a window sliding by `stride` gives it
        begin = max(0, math.ceil((t + 1 - length) / stride) * stride)
        context = torch.tensor(stream[begin : t + 1])[None]
        with torch.no_grad():
            logits = model(input_ids=context).logits[0, -2].double()
        nll -= F.log_softmax(logits, -1)[stream[t]].item()
    return math.exp(nll / (len(stream) - 1))


def run_eval(*args, capsys=None) -> int:
    return main(["eval", "--data", str(EVAL_DATA), "--no-progress", *map(str, args)])


@pytest.mark.parametrize("kind", ["llama", "path", "qwen3"])
def test_perplexity_matches_a_direct_computation(kind, checkpoints, tokenizer, tmp_path, capsys):
    output = tmp_path / "eval.json"
    code = run_eval(
        "--model", checkpoints[kind], "--lengths", "32,64,128", "--max-tokens", MAX_TOKENS, "--passkey-trials", 0,
        "--output", output,
    )  # fmt: skip
    assert code == 0
    report = json.loads(output.read_text())
    record = report["models"][kind]
    model = AutoModelForCausalLM.from_pretrained(checkpoints[kind]).eval()
    stream = stream_of(tokenizer)
    assert record["tokens"] == len(stream) == MAX_TOKENS
    for length in (32, 64, 128):
        entry = record["lengths"][str(length)]
        assert entry["ppl"] == pytest.approx(direct_ppl(model, stream, length), rel=1e-5)
        assert entry["tokens"] == MAX_TOKENS - math.ceil(MAX_TOKENS / length)
    table = capsys.readouterr().out
    assert f"| {kind} |" in table and "32 (1x)" in table and "128 (4x)" in table


def test_sliding_windows_match_a_direct_computation(checkpoints, tokenizer, tmp_path):
    output = tmp_path / "eval.json"
    code = run_eval(
        "--model", checkpoints["path"], "--lengths", "32,48", "--stride", 8, "--max-tokens", 96,
        "--passkey-trials", 0, "--output", output,
    )  # fmt: skip
    assert code == 0
    model = AutoModelForCausalLM.from_pretrained(checkpoints["path"]).eval()
    stream = stream_of(tokenizer, 96)
    lengths = json.loads(output.read_text())["models"]["path"]["lengths"]
    for length in (32, 48):
        assert lengths[str(length)]["tokens"] == 95
        assert lengths[str(length)]["ppl"] == pytest.approx(direct_ppl(model, stream, length, stride=8), rel=1e-5)


@pytest.mark.parametrize(
    "kind, rope_type", [("llama", "yarn"), ("llama", "dynamic"), ("llama", "linear"), ("qwen3", "yarn")]
)
def test_rope_scaling_is_transformers_own(kind, rope_type, checkpoints, tokenizer, tmp_path):
    """`PATH@yarn` (and @dynamic, @linear) gives what a model loaded with those `rope_parameters` gives."""
    output = tmp_path / "eval.json"
    code = run_eval(
        "--model", f"scaled={checkpoints[kind]}@{rope_type}", "--model", f"plain={checkpoints[kind]}",
        "--lengths", "32,64,128", "--max-tokens", 128, "--passkey-trials", 0, "--output", output,
    )  # fmt: skip
    assert code == 0
    models = json.loads(output.read_text())["models"]
    stream = stream_of(tokenizer, 128)
    theta = AutoConfig.from_pretrained(checkpoints[kind]).rope_parameters["rope_theta"]
    for length in (32, 64, 128):
        factor = 1.0 if rope_type == "dynamic" else length / TRAIN_LENGTH
        parameters = {"rope_type": rope_type, "rope_theta": theta, "factor": factor}
        if rope_type == "yarn":
            parameters["original_max_position_embeddings"] = TRAIN_LENGTH
        reference = AutoModelForCausalLM.from_pretrained(checkpoints[kind], rope_parameters=parameters).eval()
        scaled = models["scaled"]["lengths"][str(length)]
        assert scaled["ppl"] == pytest.approx(direct_ppl(reference, stream, length), rel=1e-5)
        assert scaled["rope_factor"] == factor
    # At the training length the scaling changes nothing (dynamic and YaRN with factor 1), beyond it, it does.
    assert models["scaled"]["lengths"]["128"]["ppl"] != pytest.approx(models["plain"]["lengths"]["128"]["ppl"])
    if rope_type != "linear":
        assert models["scaled"]["lengths"]["32"]["ppl"] == pytest.approx(models["plain"]["lengths"]["32"]["ppl"])


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic"])
def test_scaling_that_is_the_identity_reuses_the_unscaled_model(rope_type, checkpoints, tokenizer, tmp_path):
    """Where YaRN (factor 1) or dynamic NTK (up to the training length) is the identity, the unscaled model's entry
    of the same run is reused, not recomputed; beyond it the scaled model is evaluated (as transformers builds it)."""
    output = tmp_path / "eval.json"
    code = run_eval(
        "--model", f"plain={checkpoints['llama']}", "--model", f"scaled={checkpoints['llama']}@{rope_type}",
        "--lengths", "32,64,128", "--max-tokens", 128, "--passkey-trials", 0, "--output", output,
    )  # fmt: skip
    assert code == 0
    models = json.loads(output.read_text())["models"]
    plain, scaled = models["plain"]["lengths"], models["scaled"]["lengths"]
    assert TRAIN_LENGTH == 32
    assert scaled["32"]["same_as_unscaled"] and scaled["32"]["ppl"] == plain["32"]["ppl"]
    assert "same_as_unscaled" not in scaled["64"] and "same_as_unscaled" not in scaled["128"]
    theta = AutoConfig.from_pretrained(checkpoints["llama"]).rope_parameters["rope_theta"]
    factor = 1.0 if rope_type == "dynamic" else 128 / TRAIN_LENGTH
    parameters = {"rope_type": rope_type, "rope_theta": theta, "factor": factor}
    if rope_type == "yarn":
        parameters["original_max_position_embeddings"] = TRAIN_LENGTH
    reference = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], rope_parameters=parameters).eval()
    assert scaled["128"]["ppl"] == pytest.approx(direct_ppl(reference, stream_of(tokenizer, 128), 128), rel=1e-5)
    assert scaled["128"]["ppl"] != pytest.approx(plain["128"]["ppl"])


def test_several_models_a_plot_and_passkey(checkpoints, tmp_path, capsys):
    output, plot = tmp_path / "eval.json", tmp_path / "eval.png"
    code = run_eval(
        "--model", f"RoPE={checkpoints['llama']}", "--model", f"PaTH={checkpoints['path']}", "--lengths", "32,128,256",
        "--max-tokens", 256, "--passkey-trials", 3, "--output", output, "--plot", plot,
    )  # fmt: skip
    assert code == 0
    report = json.loads(output.read_text())
    assert list(report["models"]) == ["RoPE", "PaTH"]
    for record in report["models"].values():
        lengths = record["lengths"]
        # 32 tokens cannot hold a passkey prompt: that length says so instead of failing the run.
        assert lengths["32"]["passkey"] is None and "too short for a passkey prompt" in lengths["32"]["passkey_error"]
        for entry in (lengths["128"], lengths["256"]):
            passkey = entry["passkey"]
            assert passkey["trials"] == 3 and passkey["found"] == sum(t["found"] for t in entry["passkey_trials"])
            assert math.isfinite(entry["ppl_second_half"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    umask = os.umask(0)
    os.umask(umask)
    assert all(path.stat().st_mode & 0o777 == 0o666 & ~umask for path in (output, plot))  # like any new file
    assert "perplexity / passkey found/trials" in capsys.readouterr().out
    assert not list(tmp_path.glob(".*"))  # no temporary files left beside the outputs


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "missing.jsonl"], "--data: no such file(s): missing.jsonl"),
        (["--model", "{llama}", "--model", "{llama}"], "share the label 'llama'"),
        (["--stride", "40"], "--stride 40 must be between 1 and the shortest length (32)"),
        (["--max-tokens", "40"], "--max-tokens 40 is below the longest length 64"),
        (["--model", "{path}@yarn"], "has rope_mode='drop' in every layer: the model uses no RoPE"),
        (["--model", "{tmp}/nothing-here"], "nothing-here: no such file or directory"),
        # every number in its range, before any data or model is read
        (["--train-length", "-64"], "--train-length must be at least 1 (the models' training context, in tokens), "
         "got -64"),
        (["--model", "{llama}@yarn", "--train-length", "0"], "--train-length must be at least 1"),
        (["--max-tokens", "0"], "--max-tokens must be at least 1 (tokens of --data to evaluate on), got 0"),
        (["--stride", "0"], "--stride must be at least 1 (tokens a sliding window moves by), got 0"),
        (["--batch-size", "-2"], "--batch-size must be at least 1 (windows per forward pass), got -2"),
        (["--passkey-trials", "-1"], "--passkey-trials must be at least 0 (0 skips the passkey test), got -1"),
        (["--seed", "-1"], "--seed must be at least 0 (the seed of the passkey prompts), got -1"),
    ],
)  # fmt: skip
def test_refusals(args, message, checkpoints, tmp_path, capsys):
    args = [arg.format(llama=checkpoints["llama"], path=checkpoints["path"], tmp=tmp_path) for arg in args]
    models = [] if "--model" in args else ["--model", str(checkpoints["llama"])]
    output = tmp_path / "eval.json"
    command = ["eval", *models, "--data", str(EVAL_DATA), "--lengths", "32,64", "--passkey-trials", "0"]
    code = main([*command, "--no-progress", "--output", str(output), *args])
    assert code == 1
    err = capsys.readouterr().err
    assert message in err.splitlines()[-1] and "Traceback" not in err
    assert not output.exists()


def refused_before_work(capsys, checkpoints, *args) -> str:
    """The one line of a `path-hf eval` refused before it read the data or a model (no progress, no result line)."""
    command = ["eval", "--model", str(checkpoints["llama"]), "--data", str(EVAL_DATA), "--lengths", "32"]
    assert main([*command, "--passkey-trials", "0", *map(str, args)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


def test_outputs_that_could_not_be_written(checkpoints, tmp_path, capsys):
    """Checked before the evaluation starts, which used to run whole and fail at the end; nothing is written."""
    folder = tmp_path / "results"
    folder.mkdir()
    for force in ([], ["--force"]):  # --force replaces a file, never a directory
        err = refused_before_work(capsys, checkpoints, "--output", folder, *force)
        assert err == f"error: --output {folder} is a directory: give a file path"
    err = refused_before_work(capsys, checkpoints, "--plot", tmp_path / "missing" / "eval.png")
    assert (
        err == f"error: --plot {tmp_path / 'missing' / 'eval.png'}: its directory does not exist: create it or "
        "choose another path"
    )
    # A directory that takes no new files: read-only for a user; root writes in any directory, not in /sys.
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    if os.access(read_only, os.W_OK):
        read_only = Path("/sys")
    err = refused_before_work(capsys, checkpoints, "--output", read_only / "eval.json")
    assert (
        err == f"error: --output {read_only / 'eval.json'}: cannot write in {read_only} (Permission denied): "
        "choose another path"
    )
    err = refused_before_work(capsys, checkpoints, "--plot", tmp_path / "plot.txt")
    assert (
        err.startswith(
            f"error: --plot {tmp_path / 'plot.txt'}: matplotlib cannot write .txt files: end the name with one of "
        )
        and ".png, " in err
        and ".svg" in err
    )
    err = refused_before_work(capsys, checkpoints, "--plot", tmp_path / "plot")
    assert err.startswith(f"error: --plot {tmp_path / 'plot'}: no suffix names the format: end the name with one of")
    err = refused_before_work(capsys, checkpoints, "--output", tmp_path / "eval.png", "--plot", tmp_path / "eval.png")
    assert err == f"error: --output and --plot are the same file, {tmp_path / 'eval.png'}: give two paths"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["read-only", "results"]
    assert not any(folder.iterdir()) and not any((tmp_path / "read-only").iterdir())


def test_too_little_text_and_existing_output(checkpoints, tmp_path, capsys):
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "A few words only."}) + "\n")
    output = tmp_path / "eval.json"
    code = main(["eval", "--model", str(checkpoints["llama"]), "--data", str(short), "--lengths", "32,64"])
    assert code == 1
    assert "fewer than the longest length 64: give more text" in capsys.readouterr().err
    output.write_text("mine")
    command = ["eval", "--model", str(checkpoints["llama"]), "--data", str(EVAL_DATA), "--lengths", "32"]
    assert main([*command, "--output", str(output), "--passkey-trials", "0"]) == 1
    assert "exists: pass --force" in capsys.readouterr().err
    assert output.read_text() == "mine"
    assert main([*command, "--output", str(output), "--passkey-trials", "0", "--force", "--no-progress"]) == 0
    assert json.loads(output.read_text())["lengths"] == [32]


def test_model_specs_and_lengths():
    assert ModelSpec.parse("runs/x/final") == ModelSpec("final", "runs/x/final")
    assert ModelSpec.parse("src=a/b@yarn") == ModelSpec("src", "a/b", "yarn")
    assert ModelSpec.parse("a/b@dynamic:2") == ModelSpec("b+dynamic", "a/b", "dynamic", 2.0)
    assert ModelSpec.parse("meta-llama/Llama-3.2-1B@yarn:4.5").rope_factor == 4.5
    with pytest.raises(ValueError, match="at least 1"):
        ModelSpec.parse("a@yarn:0.5")
    assert parse_lengths("512, 256,256") == (256, 512)
    for bad in ("", "1", "a,b"):
        with pytest.raises(ValueError, match="--lengths"):
            parse_lengths(bad)
    with pytest.raises(SystemExit):  # argparse: exit code 2 and the message
        main(["eval", "--model", "x", "--data", "y", "--lengths", "1"])


def test_the_stream_is_the_recipes(tokenizer):
    """One implementation: `tokenize_stream` is what the recipes evaluate on."""
    assert tokenize_stream(read_texts([EVAL_DATA]), tokenizer, MAX_TOKENS) == stream_of(tokenizer)


def test_an_output_made_by_another_run_meanwhile_is_kept(checkpoints, tmp_path, monkeypatch, capsys):
    """Two runs with one --output: the file that the other run wrote while this one measured is not replaced (the
    check at the start cannot see it); this run's results are kept beside it, named in a one-line error."""
    import path_hf.commands.eval as eval_command

    output = tmp_path / "eval.json"
    table = eval_command.format_table

    def other_run_finishes_first(report):
        output.write_text('{"models": {"other": {}}}\n')
        return table(report)

    monkeypatch.setattr(eval_command, "format_table", other_run_finishes_first)
    code = run_eval("--model", checkpoints["llama"], "--lengths", "32", "--max-tokens", 64, "--output", output)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and json.loads(output.read_text()) == {"models": {"other": {}}}
    assert err[-1].startswith(f"error: {output} was written by another process while this evaluation ran")
    kept = Path(err[-1].split("this one's is kept in ")[1].split(":")[0])
    assert kept.parent == tmp_path and list(json.loads(kept.read_text())["models"]) == ["llama"]
    # With --force the file is replaced.
    assert run_eval("--model", checkpoints["llama"], "--lengths", "32", "--max-tokens", 64, "--output", output,
                    "--force") == 0  # fmt: skip
    assert list(json.loads(output.read_text())["models"]) == ["llama"]


@pytest.mark.parametrize("dropped", ["model.layers.1.self_attn.q_proj.weight", "w_proj"])
def test_a_checkpoint_with_missing_weights_is_refused(checkpoints, tmp_path, capsys, dropped):
    """A converted checkpoint without one projection, or without every PaTH tensor, would be scored with random
    weights in their place: refused, the missing weights named."""
    import shutil

    from safetensors.torch import load_file, save_file

    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoints["path"], damaged)
    tensors = load_file(damaged / "model.safetensors")
    removed = sorted(name for name in tensors if dropped in name)
    assert removed
    save_file({k: v for k, v in tensors.items() if k not in removed}, damaged / "model.safetensors", {"format": "pt"})
    output = tmp_path / "eval.json"
    assert run_eval("--model", damaged, "--lengths", "32", "--max-tokens", 64, "--output", output) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: --model {damaged}: {len(removed)} weight(s) of the model are missing"), err
    assert removed[0] in err and not output.exists()


def test_yarn_on_a_model_without_rope_is_refused_before_anything_runs(checkpoints, tmp_path, capsys):
    """`@yarn` on a model whose every layer drops RoPE scales nothing: refused before any model is evaluated, also
    when the unscaled model comes first (which would otherwise be measured and then copied into a `+yarn` row)."""
    path = checkpoints["path"]
    assert json.loads((path / "config.json").read_text())["rope_mode"] == "drop"
    output = tmp_path / "eval.json"
    code = run_eval("--model", f"plain={path}", "--model", f"scaled={path}@yarn", "--lengths", "32,64",
                    "--max-tokens", 64, "--output", output)  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1 and "error: --model scaled: @yarn: " in err and "uses no RoPE" in err, err
    assert "ppl" not in err and not output.exists()  # nothing was measured


def test_nan_weights_are_named_before_any_model_is_evaluated(checkpoints, tmp_path, capsys):
    """NaN in a PaTH layer: the tensor is named (not 'attends in both directions'), and the model given first is
    not evaluated before the refusal."""
    import shutil

    from safetensors.torch import load_file, save_file

    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoints["path"], damaged)
    tensors = load_file(damaged / "model.safetensors")
    name = next(name for name in sorted(tensors) if "w_proj" in name)
    tensors[name].view(-1)[:2] = float("nan")
    save_file(tensors, damaged / "model.safetensors", {"format": "pt"})
    code = run_eval("--model", f"good={checkpoints['llama']}", "--model", f"bad={damaged}", "--lengths", "32",
                    "--max-tokens", 64)  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1 and f"error: --model {damaged}: tensor {name!r} of model.safetensors holds 2 NaN" in err, err
    assert "ppl" not in err and "both directions" not in err
