"""The files a conversion carries over from the source, and the card it writes: a tokenizer config's map to source
code that is not copied is dropped (and said), malformed JSON is refused, a source without a tokenizer is said, and the
card keeps the source's licence and names it without this machine's folders."""

import json

from transformers import AutoTokenizer

from tests.conversion.checkpoints import make_source, run_cli


def convert(capsys, tmp_path, source, *flags):
    output = tmp_path / "converted"
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", output, *flags)
    return code, out, err, output


def test_a_tokenizer_auto_map_is_dropped_and_the_tokenizer_loads_with_remote_code(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama", tokenizer=True)
    config_file = source / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**tokenizer_config, "auto_map": {"AutoTokenizer": ["tok.MyTokenizer", None]}}))
    code, out, err, output = convert(capsys, tmp_path, source)
    assert code == 0, err
    assert "note: tokenizer_config.json's auto_map dropped" in out
    assert json.loads((output / "tokenizer_config.json").read_text()) == tokenizer_config
    tokenizer = AutoTokenizer.from_pretrained(output, trust_remote_code=True)
    assert tokenizer("hello world")["input_ids"] == AutoTokenizer.from_pretrained(source)("hello world")["input_ids"]


def test_malformed_json_of_the_source_is_refused(tmp_path, capsys):
    for name in ("tokenizer_config.json", "generation_config.json"):
        source = make_source(tmp_path / name / "source", "llama", tokenizer=True)
        (source / name).write_text('{"bos_token": ')
        code, _, err, output = convert(capsys, tmp_path / name, source)
        assert code == 1 and f"error: the source's {name} is not valid JSON" in err, err
        assert not output.exists()


def test_a_source_without_a_tokenizer_is_said(tmp_path, capsys):
    code, out, err, output = convert(capsys, tmp_path, make_source(tmp_path / "source", "llama"))
    assert code == 0 and "note: the source has no tokenizer files" in out and not err
    assert not (output / "tokenizer.json").exists()


def test_the_card_keeps_the_licence_and_names_no_local_folder(tmp_path, capsys):
    source = make_source(tmp_path / "my-model", "llama", tokenizer=True)
    (source / "README.md").write_text("---\nlicense: apache-2.0\n---\n\n# my model\n")
    code, _, err, output = convert(capsys, tmp_path, source)
    assert code == 0, err
    card = (output / "README.md").read_text()
    assert "license: apache-2.0" in card.split("---")[1]
    assert "`my-model`" in card and "source:       my-model" in card
    assert str(tmp_path) not in card
