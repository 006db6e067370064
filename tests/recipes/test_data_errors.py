"""A recipe's data files that cannot be read: one line naming the field, the file and what is wrong with it (`datasets`
said "An error occurred while generating the dataset", in three chained tracebacks), before any work starts."""

import pytest

from tests.recipes.recipe_runs import DATA, recipe_config, run_recipe

# A PNG renamed: its first byte, 0x89, starts no UTF-8 character.
BINARY = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
BROKEN = DATA.read_bytes().splitlines(keepends=True)[0] + b'{"text": "A record cut short\n'


@pytest.mark.parametrize("streaming", [False, True], ids=["loaded", "streamed"])
@pytest.mark.parametrize(
    "field, content, cause",
    [
        ("train_files", BINARY, "line 1 is not UTF-8 text (byte 0x89 at column 1)"),
        ("train_files", BROKEN, "line 2 is not JSON (column 10: Unterminated string starting at)"),
        ("eval_files", BROKEN, "line 2 is not JSON (column 10: Unterminated string starting at)"),
    ],
    ids=["binary", "malformed", "malformed-eval"],
)
def test_unreadable_data_files(field, content, cause, streaming, tiny_source, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    config = recipe_config(tiny_source, tmp_path / "run", data={field: [str(data)], "streaming": streaming})
    assert run_recipe(config, tmp_path) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"error: data.{field}: cannot read {data} as JSON: {cause}"
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_a_bad_record_a_stream_reaches_late_is_named_and_the_state_saved(tiny_source, tmp_path, capsys, monkeypatch):
    """A streamed file whose fault lies past what is read at the start (datasets reads JSON in 10 MB chunks) fails
    only at the step that reaches it, with pyarrow's own error. The run names the file and the line, saves the state
    before that step and says to resume; it does not end in a traceback."""
    import pyarrow

    from path_hf.recipes import train

    data = tmp_path / "data.jsonl"
    good = DATA.read_bytes()
    data.write_bytes(good + good)
    endless = train.endless_batches

    def stream_that_fails_at_step_2(dataloader, start):
        batches = endless(dataloader, start)
        yield next(batches)
        # what lies 10 MB into a file: read only now, after the checks at the start passed
        data.write_bytes(good + b'{"text": "cut short\n' + good)
        raise pyarrow.lib.ArrowInvalid("JSON parse error: Missing a closing quotation mark in string. in row 0")

    monkeypatch.setattr(train, "endless_batches", stream_that_fails_at_step_2)
    out = tmp_path / "run"
    config = recipe_config(tiny_source, out, data={"train_files": [str(data)], "streaming": True})
    assert run_recipe(config, tmp_path) == 1
    err = capsys.readouterr().err.strip().splitlines()
    line = len(good.splitlines()) + 1
    assert err[-1].startswith(f"error: the training data cannot be read at step 2 ({data}: line {line} is not JSON")
    assert f"the state before that step is saved in {out / 'checkpoints' / 'step-00000001'}" in err[-1]
    assert (out / "checkpoints" / "step-00000001" / "run_state.json").is_file()


def test_records_without_the_text_field_are_said(tmp_path, capsys):
    from path_hf.evaluation import read_texts

    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "one"}\n{"body": "two"}\n{"text": "three"}\n{"title": "four"}\n')
    assert read_texts([str(data)]) == ["one", "three"]
    assert f"warning: 2 of the 4 records of {data} have no 'text' field and are left out" in capsys.readouterr().err
