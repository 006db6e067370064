"""examples/smollm2/run.py's parts without models: which steps run (and which are added because a named step needs
them), the cells of a row under the protocol, and a results.json row and the README table made from cell reports."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("smollm2_run", ROOT / "examples" / "smollm2" / "run.py")
run_py = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = run_py  # dataclasses look their module up while the file executes
_spec.loader.exec_module(run_py)


@pytest.fixture
def plan(tmp_path):
    return run_py.Plan(run_py.parse_args(["--output", str(tmp_path / "smollm2"), "--gguf", str(tmp_path / "x.gguf")]))


def test_a_named_step_adds_only_the_unfinished_steps_it_needs(plan):
    rows = plan.rows()
    finished = dict.fromkeys(run_py.STEPS, False) | {"fetch": True, "baselines": True}
    order, added = run_py.steps_to_run({"summary"}, finished, [r for r in rows if r.kind == "control"])
    assert order == ["control", "eval", "summary"] and added == ["control", "eval"]
    order, added = run_py.steps_to_run({"eval"}, finished, [r for r in rows if r.kind == "streaming"])
    assert order == ["eval"] and added == []  # the baselines are there
    order, _ = run_py.steps_to_run({"eval"}, finished, [r for r in rows if r.kind == "path"])
    assert order == ["convert", "train", "eval"]  # train needs convert: needs are followed through
    order, _ = run_py.steps_to_run(set(), finished | {"convert": True}, rows)
    assert order == ["train", "control", "eval", "summary"]  # nothing named: every unfinished step


def test_rows_and_cells_follow_the_protocol(plan):
    rows = plan.rows()
    assert [row.kind for row in rows if row.shipped] == ["path"] and len({row.label for row in rows}) == len(rows)
    plan.protocol["other_windows"] = [8192, plan.inference_window, 1024]  # the shipped window is not a second row
    windows = [row.local_window for row in plan.rows() if row.kind == "path"]
    assert windows == [None, 1024, 8192]  # the shipped row keeps the window it was converted with
    plan.protocol["other_windows"] = []
    assert [row.local_window for row in plan.rows() if row.kind == "path"] == [None]
    protocol = plan.protocol
    names = [cell.name for cell in run_py.cells(plan, rows[0])]
    assert names == [f"ppl-{text}" for text in protocol["texts"]] + [
        f"retrieval-{n}" for n in sorted({*protocol["retrieval"]["passkey"], *protocol["retrieval"]["multikey"]})
    ]
    retrieval = run_py.cells(plan, rows[0])[-1].flags
    length = int(names[-1].removeprefix("retrieval-"))
    assert retrieval[retrieval.index("--passkey-trials") + 1] == protocol["retrieval"]["passkey"].get(length, 0)


def test_a_row_and_the_table_come_from_the_cell_reports(plan):
    row = next(row for row in plan.rows() if row.kind == "source")
    for cell in run_py.cells(plan, row):
        lengths = {}
        if cell.name.startswith("ppl-"):
            lengths = {str(n): {"ppl": 10.0 + n / 1024} for n in plan.protocol["perplexity"]["lengths"]}
        else:
            summary = {"found": 3, "trials": 10, "wilson95": [0.1, 0.6], "nll": 1.5, "by_depth": {"0.1": [0, 2]}}
            summary |= {"greedy_agrees": 1, "greedy_checked": 1}
            lengths = {cell.name.removeprefix("retrieval-"): {"passkey": summary, "multikey": None}}
        cell.output(plan).parent.mkdir(parents=True, exist_ok=True)
        report = {"models": {row.label: {"lengths": lengths}}, "cpu_minutes": 2.5}
        cell.output(plan).write_text(json.dumps(report))
    result = run_py.row_result(plan, row)
    texts = list(plan.protocol["texts"])
    assert result["ppl"][texts[0]]["2048"] == 12.0 and result["training_tokens"] == 0
    length = next(iter(result["passkey"]))
    assert result["passkey"][length]["found"] == 3 and result["passkey"][length]["greedy"] == [1, 1]
    assert result["multikey"] == {} and set(result["cpu_minutes"]) == {c.name for c in run_py.cells(plan, row)}
    table = run_py.table({"protocol": plan.protocol, "rows": [result]}).splitlines()
    header = [part.strip() for part in table[0].strip("|").split("|")]
    assert header[:2] == ["model", "training tokens (min)"] and f"passkey {length}" in header
    assert table[2].startswith("| source | 0 (0) |") and "3/10" in table[2] and "26.00" in table[2]


def test_the_published_results_follow_the_schema_and_make_the_readme_table():
    """docs/smollm2/results.json: one row per model of the schema's kinds, exactly one shipped (the model make
    smollm2 builds), all on the protocol it records; the README's SmolLM2 table is the one made from it."""
    results = json.loads((ROOT / "docs" / "smollm2" / "results.json").read_text())
    rows = results["rows"]
    assert [row["kind"] for row in rows if row["shipped"]] == ["path"]
    assert {row["kind"] for row in rows} <= {"source", "source+yarn", "streaming", "heads", "control", "path"}
    for row in rows:
        assert {"label", "kind", "shipped", "recipe_minutes", "training_tokens", "ppl", "passkey", "multikey"} <= set(
            row
        )
        for cell in [*row["passkey"].values(), *row["multikey"].values()]:
            assert 0 <= cell["found"] <= cell["trials"]
    assert results["protocol"]["retrieval"]["passkey"] and not any(
        Path(row["model"].split("@")[0]).is_absolute() for row in rows
    )
    assert run_py.table(results) in (ROOT / "README.md").read_text()
