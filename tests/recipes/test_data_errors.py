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
