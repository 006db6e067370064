"""What `path-hf eval` refuses to score, and the inputs it reads: empty data, a data directory, `PATH@ROPE` specs,
models that are not causal decoders, and tokenizers that are missing or do not fit the text."""

import gzip
import json
import re
import shutil

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import (
    AutoModelForCausalLM,
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertLMHeadModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from path_hf.cli import main
from path_hf.evaluation import ModelSpec, attends_causally, data_files, load_texts, read_texts
from tests.evaluation.eval_models import EVAL_DATA, TOKENIZER, shapes


def run_eval(capsys, *args) -> tuple[int, str]:
    """`path-hf eval` at lengths 32 and 64 without passkey; returns the exit code and stderr."""
    command = ["eval", "--lengths", "32,64", "--max-tokens", "64", "--passkey-trials", "0", "--no-progress"]
    code = main([*command, *map(str, args)])
    return code, capsys.readouterr().err


def refused(capsys, *args, output) -> str:
    """The one-line error of a refused `path-hf eval` (after any progress bars of `datasets`), which wrote nothing."""
    code, err = run_eval(capsys, *args, "--output", output)
    last = err.splitlines()[-1]
    assert code == 1 and last.startswith("error: ") and "Traceback" not in err, err
    assert not output.exists()
    return last


@pytest.fixture(scope="module")
def foreign(tmp_path_factory, tokenizer) -> dict:
    """Tiny checkpoints eval must refuse or needs help with: BERT (bidirectional) and GPT-2 saved without a tokenizer,
    BART (an encoder-decoder) and a Llama whose word-level tokenizer knows a handful of words."""
    root = tmp_path_factory.mktemp("foreign")
    torch.manual_seed(0)
    vocab, small = len(tokenizer), dict(hidden_size=32, num_attention_heads=4, intermediate_size=64)
    paths = {name: root / name for name in ("bert", "gpt2", "bart", "words")}
    BertLMHeadModel(
        BertConfig(vocab_size=vocab, num_hidden_layers=2, max_position_embeddings=128, **small)
    ).save_pretrained(paths["bert"])
    gpt2 = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=128)
    GPT2LMHeadModel(gpt2).save_pretrained(paths["gpt2"])
    bart = BartConfig(
        vocab_size=vocab, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
    )  # fmt: skip
    BartForConditionalGeneration(bart).save_pretrained(paths["bart"])
    tokenizer.save_pretrained(paths["bart"])
    words = {"[UNK]": 0, "</s>": 1, "the": 2, "of": 3, "and": 4, ".": 5, ",": 6, "a": 7}
    backend = Tokenizer(WordLevel(words, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>").save_pretrained(
        paths["words"]
    )
    config = LlamaConfig(**(shapes(tokenizer) | {"vocab_size": len(words), "bos_token_id": None, "eos_token_id": 1}))
    config.pad_token_id = None
    LlamaForCausalLM(config).save_pretrained(paths["words"])
    return paths


# Data


@pytest.mark.parametrize(
    "name, content",
    [
        ("empty.jsonl", b""),
        ("empty.txt", b""),
        ("empty.parquet", b""),
        ("blank.jsonl", b"\n  \n"),
        ("whitespace-documents.jsonl", b'{"text": "  "}\n{"text": "\\n\\t"}\n'),
        ("whitespace-documents.txt", b"  \n\n \t\n\n"),
    ],
)
def test_data_without_documents(name, content, checkpoints, tmp_path, capsys):
    data = tmp_path / name
    data.write_bytes(content)
    err = refused(capsys, "--model", checkpoints["llama"], "--data", data, output=tmp_path / "eval.json")
    assert err == f"error: --data {data}: no non-empty documents"


# A PNG renamed: its first byte, 0x89, starts no UTF-8 character.
BINARY = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
BROKEN_JSONL = b'{"text": "The first record."}\n{"text": "The second, cut short\n'
UNREADABLE = [
    ("png.jsonl", BINARY, "JSON: line 1 is not UTF-8 text (byte 0x89 at column 1)"),
    ("png.txt", BINARY, "text: line 1 is not UTF-8 text (byte 0x89 at column 1)"),
    ("png.parquet", BINARY, "parquet: Parquet magic bytes not found in footer. Either the file is corrupted or this "
     "is not a parquet file."),
    ("broken.jsonl", BROKEN_JSONL, "JSON: line 2 is not JSON (column 10: Unterminated string starting at)"),
    ("broken.jsonl.gz", gzip.compress(BROKEN_JSONL), "JSON: line 2 is not JSON (column 10: Unterminated string "
     "starting at)"),
    ("png.jsonl.xz", BINARY, "JSON: it does not decompress as .xz (Input format not supported by decoder)"),
    ("broken.json", b'[{"text": "a"},\n {"text": "b"}\n', "JSON: it is not JSON (line 3, column 1: Expecting ',' "
     "delimiter)"),
    ("strings.jsonl", b'"a string"\n"another"\n', "JSON: line 1 is a JSON string, not an object (JSON lines hold "
     "one record a line)"),
]  # fmt: skip


@pytest.mark.parametrize("name, content, cause", UNREADABLE, ids=[case[0] for case in UNREADABLE])
def test_unreadable_data(name, content, cause, checkpoints, tmp_path, capsys):
    """`datasets` says "An error occurred while generating the dataset"; the refusal names the file and what is
    wrong with it, also when streamed (as the recipes may read it): its first records are read at once."""
    data = tmp_path / name
    data.write_bytes(content)
    err = refused(capsys, "--model", checkpoints["llama"], "--data", data, output=tmp_path / "eval.json")
    assert err == f"error: --data: cannot read {data} as {cause}"
    with pytest.raises(ValueError, match=re.escape(f"cannot read {data} as {cause}")):
        load_texts([data], streaming=True)


def test_a_text_field_that_holds_no_text(tmp_path, capsys, checkpoints):
    data = tmp_path / "numbers.jsonl"
    data.write_text('{"text": 5}\n{"text": 7}\n')
    for streaming in (False, True):
        with pytest.raises(ValueError, match=re.escape(f"{data}: column 'text' holds int64 values, not text")):
            load_texts([data], streaming=streaming)
    err = refused(capsys, "--model", checkpoints["llama"], "--data", data, output=tmp_path / "eval.json")
    assert err == f"error: --data: {data}: column 'text' holds int64 values, not text: set the text field"


def test_blank_files_are_skipped(tmp_path):
    """The recipes read their data through the same function: an empty file among others adds no documents."""
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert read_texts([tmp_path / "empty.jsonl", EVAL_DATA]) == read_texts([EVAL_DATA])


def test_a_data_directory(checkpoints, tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    for name in ("b.jsonl", "a.jsonl.xz", ".hidden.jsonl", "notes.md"):
        shutil.copy(EVAL_DATA, folder / name)
    (folder / "b.jsonl").write_text(json.dumps({"text": "The last document."}) + "\n")
    (folder / "nested.jsonl").mkdir()
    assert data_files([folder]) == ("json", {"data_files": [str(folder / "a.jsonl.xz"), str(folder / "b.jsonl")]})
    assert read_texts([folder]) == [*read_texts([EVAL_DATA]), "The last document."]

    output = tmp_path / "eval.json"
    code, err = run_eval(capsys, "--model", checkpoints["llama"], "--data", folder, "--output", output)
    assert code == 0, err
    assert json.loads(output.read_text())["models"]["llama"]["tokens"] == 64

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.md").write_text("no data here")
    err = refused(capsys, "--model", checkpoints["llama"], "--data", empty, output=output.with_name("none.json"))
    assert f"--data: {empty} is a directory with no data files (looked for *.txt, *.jsonl, *.json, *.parquet" in err


# PATH@ROPE


def test_rope_suffixes(tmp_path, monkeypatch):
    assert ModelSpec.parse("a/b@YARN:2") == ModelSpec("b+yarn", "a/b", "yarn", 2.0)  # the type in any case
    assert ModelSpec.parse("L=runs/lr=1e-3/final@Dynamic") == ModelSpec("L", "runs/lr=1e-3/final", "dynamic")
    for spec, message in [
        ("a/b@longrope", "unknown RoPE scaling 'longrope' (choices: linear, dynamic, yarn, then optionally :FACTOR)"),
        ("a/b@yarn:abc", "the RoPE scaling factor must be a number of at least 1, got 'abc'"),
        ("a/b@yarn:", "the RoPE scaling factor must be a number of at least 1, got ''"),
        ("a/b@linear:inf", "the RoPE scaling factor must be a number of at least 1, got 'inf'"),
        ("a/b@yarn:0.5", "the RoPE scaling factor must be a number of at least 1, got '0.5'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"--model '{spec}': {message}")):
            ModelSpec.parse(spec)
    # A path that exists is taken whole, '@' and all; a scaling may follow it.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt@v2").mkdir()
    assert ModelSpec.parse("ckpt@v2") == ModelSpec("ckpt@v2", "ckpt@v2")
    assert ModelSpec.parse("ckpt@v2@yarn") == ModelSpec("ckpt@v2+yarn", "ckpt@v2", "yarn")
    assert ModelSpec.parse("x@y/ckpt") == ModelSpec("ckpt", "x@y/ckpt")  # '@' before the last '/': never a scaling


def test_a_directory_with_at_in_its_name_evaluates(checkpoints, tmp_path, capsys):
    (tmp_path / "llama@v2").symlink_to(checkpoints["llama"], target_is_directory=True)
    output = tmp_path / "eval.json"
    code, err = run_eval(capsys, "--model", tmp_path / "llama@v2", "--data", EVAL_DATA, "--output", output)
    assert code == 0, err
    assert list(json.loads(output.read_text())["models"]) == ["llama@v2"]
    with pytest.raises(SystemExit):  # argparse's refusal (exit code 2), naming the choices
        run_eval(capsys, "--model", f"{checkpoints['llama']}@longrope", "--data", EVAL_DATA)
    assert (
        "unknown RoPE scaling 'longrope' (choices: linear, dynamic, yarn, then optionally :FACTOR)"
        in capsys.readouterr().err
    )


# Models that are not causal decoders


def test_the_causality_probe(checkpoints, foreign):
    bert = AutoModelForCausalLM.from_pretrained(foreign["bert"])
    assert not attends_causally(bert)
    for kind in ("llama", "path", "qwen3"):
        model = AutoModelForCausalLM.from_pretrained(checkpoints[kind]).train()
        assert attends_causally(model) and model.training  # left in the mode it was in
        assert attends_causally(model.to(torch.bfloat16))


def test_a_bidirectional_model_is_refused(foreign, tmp_path, capsys):
    err = refused(
        capsys, "--model", foreign["bert"], "--tokenizer", TOKENIZER, "--data", EVAL_DATA, output=tmp_path / "e.json"
    )
    assert f"--model {foreign['bert']} (BertLMHeadModel) attends in both directions: not a causal decoder" in err


def test_an_encoder_decoder_is_refused(foreign, tmp_path, capsys):
    err = refused(capsys, "--model", foreign["bart"], "--data", EVAL_DATA, output=tmp_path / "e.json")
    assert f"--model {foreign['bart']} is an encoder-decoder model (BartConfig): not a causal decoder" in err


# Tokenizers


def test_a_checkpoint_without_a_tokenizer(foreign, tmp_path, capsys):
    for kind in ("bert", "gpt2"):
        err = refused(capsys, "--model", foreign[kind], "--data", EVAL_DATA, output=tmp_path / "e.json")
        assert f"--model {foreign[kind]}: the directory holds no tokenizer files (tokenizer.json, " in err
        assert "pass --tokenizer PATH_OR_ID" in err
    err = refused(
        capsys, "--model", foreign["gpt2"], "--tokenizer", foreign["bert"], "--data", EVAL_DATA,
        output=tmp_path / "e.json",
    )  # fmt: skip
    assert f"--tokenizer {foreign['bert']}: the directory holds no tokenizer files" in err

    output = tmp_path / "eval.json"
    code, err = run_eval(
        capsys, "--model", foreign["gpt2"], "--tokenizer", TOKENIZER, "--data", EVAL_DATA, "--output", output
    )
    assert code == 0, err
    record = json.loads(output.read_text())["models"]["gpt2"]
    assert record["tokenizer"] == str(TOKENIZER) and record["tokens"] == 64


def test_a_tokenizer_without_a_vocabulary(foreign, tokenizer, tmp_path, capsys):
    """What transformers builds from a GPT-2 config without tokenizer files (one token, EOS), saved: refused."""
    from transformers import AutoTokenizer

    empty = tmp_path / "empty-tokenizer"
    AutoTokenizer.from_pretrained(foreign["gpt2"]).save_pretrained(empty)
    err = refused(
        capsys, "--model", foreign["gpt2"], "--tokenizer", empty, "--data", EVAL_DATA, output=tmp_path / "e.json"
    )
    assert f"--tokenizer {empty}: the tokenizer has no vocabulary, only 1 special token(s)" in err


def test_a_tokenizer_that_does_not_fit_the_text(foreign, tmp_path, capsys):
    err = refused(capsys, "--model", foreign["words"], "--data", EVAL_DATA, output=tmp_path / "e.json")
    assert "% of the first 64 tokens of --data are the unknown token '[UNK]'" in err
    assert f"{foreign['words']}'s tokenizer does not fit the text" in err


# Tokenizers that do not belong to the model


@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory, tokenizer) -> dict:
    """A Llama of 300 token embeddings saved without a tokenizer, the same weights saved with the default tokenizer
    (4096 tokens: not theirs), and a Llama whose vocabulary is padded past its tokenizer's (as Qwen2.5's is)."""
    root = tmp_path_factory.mktemp("vocabularies")
    torch.manual_seed(0)
    paths = {name: root / name for name in ("llama-300", "mismatched", "padded")}
    LlamaForCausalLM(LlamaConfig(**(shapes(tokenizer) | {"vocab_size": 300}))).save_pretrained(paths["llama-300"])
    shutil.copytree(paths["llama-300"], paths["mismatched"])
    tokenizer.save_pretrained(paths["mismatched"])
    LlamaForCausalLM(LlamaConfig(**(shapes(tokenizer) | {"vocab_size": len(tokenizer) + 60}))).save_pretrained(
        paths["padded"]
    )
    tokenizer.save_pretrained(paths["padded"])
    return paths


def test_token_ids_beyond_the_vocabulary(vocabularies, foreign, tmp_path, capsys):
    """A tokenizer whose ids the embedding has no row for: an `IndexError` in the first forward pass before."""
    small = vocabularies["llama-300"]
    beyond = r"writes token id \d+ on the evaluation text, and the model has 300 token embeddings"
    err = refused(capsys, "--model", small, "--tokenizer", TOKENIZER, "--data", EVAL_DATA, output=tmp_path / "e.json")
    assert re.fullmatch(
        f"error: --tokenizer {re.escape(str(TOKENIZER))} does not belong to --model {re.escape(str(small))}: "
        f"it {beyond}: give the model's own tokenizer",
        err,
    ), err
    # Several models share --tokenizer: each is checked against it, all before the first is evaluated.
    code, err = run_eval(
        capsys, "--model", foreign["gpt2"], "--model", small, "--tokenizer", TOKENIZER, "--data", EVAL_DATA
    )
    assert code == 1 and f"does not belong to --model {small}: it writes token id" in err.splitlines()[-1]
    assert " ppl " not in err  # gpt2, which fits, was not evaluated either
    # A checkpoint saved with a tokenizer that is not its own.
    err = refused(capsys, "--model", vocabularies["mismatched"], "--data", EVAL_DATA, output=tmp_path / "e.json")
    assert re.fullmatch(
        f"error: --model {re.escape(str(vocabularies['mismatched']))}: its tokenizer {beyond}: the tokenizer and "
        "the weights do not belong together; pass --tokenizer with the model's own",
        err,
    ), err


def test_a_padded_vocabulary_evaluates(vocabularies, tokenizer, tmp_path, capsys):
    """More embeddings than tokens is common (vocabularies padded to a multiple of 64 or 128): not a refusal, with
    the model's own tokenizer or the same one given by --tokenizer."""
    for args in ([], ["--tokenizer", TOKENIZER]):
        output = tmp_path / f"eval{len(args)}.json"
        code, err = run_eval(capsys, "--model", vocabularies["padded"], "--data", EVAL_DATA, "--output", output, *args)
        assert code == 0, err
        assert json.loads(output.read_text())["models"]["padded"]["tokens"] == 64


def test_a_tokenizer_of_another_model(checkpoints, other_tokenizer, tmp_path, capsys):
    """Its ids are all in the model's vocabulary, but not the model's own tokenizer's: the perplexity would be
    computed, and mean nothing."""
    model = checkpoints["llama"]
    err = refused(
        capsys, "--model", model, "--tokenizer", other_tokenizer, "--data", EVAL_DATA, output=tmp_path / "e.json"
    )
    assert err == (
        f"error: --tokenizer {other_tokenizer} does not belong to --model {model}: on the first 4000 characters of "
        "--data it writes other token ids than the model's own tokenizer (300 tokens; the model's: 4096): leave out "
        "--tokenizer to use the model's own"
    )
