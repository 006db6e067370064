# Copyright 2026 The path-hf authors. Apache-2.0.
"""A long-context comparison of model variants under one fixed protocol, each evaluation a one-thread process.

```
python examples/smollm2/screen.py examples/smollm2/screens/no-training.yaml --output runs/screen/no-training
```

The screen file names the texts, the lengths, the tokens read and the rows; a row is a model (`{gguf}`, `{converted}`,
`{recovered}` and `{long_tuned}` stand for `make smollm2`'s files under `--smollm2`, default runs/smollm2, and `{band}`
for `--band`,
the critical-band run's final model), optionally with a RoPE
scaling (`@yarn`, as `path-hf eval` takes it) and config fields changed for the evaluation (`config:`; the variant is
a folder of links to the checkpoint's files beside its own config.json, made under the output) and optionally the
screen's lengths it is evaluated at (`lengths:`, default all). Retrieval runs in every cell when the screen sets
`passkey_trials` (and `passkey_depths`) or `copy_trials` (and `copy_span`), as `path-hf eval` takes them. Every (row,
text, length) is one `path-hf eval` run with OMP_NUM_THREADS=1, `--jobs` at once (default: one per core), so the whole
table comes from one run on an equal footing, and each cell records its CPU minutes (the process's own CPU time, so
a cell that shared the machine costs what it would alone; its wall minutes beside them). Cells already written are kept
(an interrupted screen resumes). Writes `screen.json` (every cell, the protocol) and `screen.md` (the table) in the
output folder.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml
from transformers import AutoConfig

import path_hf  # noqa: F401  (registers path_llama with the Auto classes)

sys.path.insert(0, str(Path(__file__).parent))
from run import Plan  # noqa: E402  (make smollm2's files)
from run import parse_args as smollm2_args  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEXTS = {
    "python-docs": "examples/default_model/data/eval.jsonl.xz",
    "copyright-does-not-exist": "examples/data/copyright_does_not_exist/eval.jsonl.xz",
    # Jane Austen's Persuasion, held out from the Austen novels the recipe trains on and used by no search: the recheck
    "persuasion": "examples/data/austen/eval.jsonl.xz",
    # training text (the recipe trains on it): where a search tunes what it then reports on the held-out texts above
    "austen-train": "examples/data/austen/train.jsonl.xz",
}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def resolve(spec: str, smollm2: Path, band: Path) -> str:
    plan = Plan(smollm2_args(["--output", str(smollm2)]))
    places = {"gguf": plan.gguf, "converted": plan.converted, "recovered": plan.recovered}
    places |= {"long_tuned": plan.long_tuned, "band": band}
    return spec.format(**{name: os.path.relpath(ROOT / path, ROOT) for name, path in places.items()})


def variant(model: str, fields: dict, folder: Path) -> str:
    """A checkpoint folder of links to `model`'s files, with `fields` changed in its config.json."""
    path, at, scaling = model.partition("@")
    source = ROOT / path
    folder.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name != "config.json" and not (folder / item.name).exists():
            (folder / item.name).symlink_to(item.resolve())
    config = json.loads((source / "config.json").read_text())
    known = set(config) | set(AutoConfig.for_model(config["model_type"]).to_dict())  # a saved config omits defaults
    unknown = [name for name in fields if name not in known]
    if unknown:
        raise SystemExit(f"error: {config['model_type']} configs have no fields {unknown} ({path}/config.json)")
    (folder / "config.json").write_text(json.dumps({**config, **fields}, indent=2) + "\n")
    return os.path.relpath(folder, ROOT) + at + scaling


def run_counted(command: list[str], env: dict, stream) -> tuple[int, float]:
    """Run `command` to its end; its exit code and the CPU seconds (user + system) that it and its children used."""
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=stream, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    return process.returncode, usage.ru_utime + usage.ru_stime


def cell(row: dict, text: str, length: int, screen: dict, out: Path, model: str) -> dict:
    """One `path-hf eval` run at one thread; its JSON is kept in `out/cells/`."""
    output = out / "cells" / f"{slug(row['label'])}--{text}--{length}.json"
    if not output.is_file():
        command = [sys.executable, "-m", "path_hf.cli", "eval", "--data", TEXTS[text], "--force", "--no-progress"]
        command += ["--lengths", str(length), "--max-tokens", str(screen["max_tokens"]), "--batch-size", "1"]
        command += ["--passkey-trials", str(screen.get("passkey_trials", 0))]
        if screen.get("copy_trials"):
            command += ["--copy-trials", str(screen["copy_trials"]), "--copy-span", str(screen.get("copy_span", 256))]
        if screen.get("passkey_depths"):
            command += ["--passkey-depths", ",".join(str(depth) for depth in screen["passkey_depths"])]
        command += ["--train-length", str(screen["train_length"]), "--output", str(output)]
        command += ["--model", f"{row['label']}={model}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        started = time.perf_counter()
        log = out / "logs" / f"{output.stem}.log"
        with open(log, "w") as stream:
            returncode, cpu_seconds = run_counted(command, env, stream)
        if returncode:
            return {"row": row["label"], "text": text, "length": length, "error": f"exit {returncode}, {log}"}
        report = json.loads(output.read_text())
        # the process's own CPU time (one thread): what the cell costs, whatever else shared the machine
        report["cpu_minutes"] = round(cpu_seconds / 60, 2)
        report["wall_minutes"] = round((time.perf_counter() - started) / 60, 2)
        output.write_text(json.dumps(report, indent=2) + "\n")
    report = json.loads(output.read_text())
    entry = report["models"][row["label"]]["lengths"][str(length)]
    passkey = f"  passkey {entry['passkey']:4.0%}" if entry.get("passkey") is not None else ""
    passkey += f"  copy {entry['copy']:5.1%}" if entry.get("copy") is not None else ""
    minutes = report["cpu_minutes"]
    print(f"{row['label']:<40} {text:<26} {length:>6}  ppl {entry['ppl']:8.3f}{passkey}  {minutes:6.1f} min")
    result = {"row": row["label"], "text": text, "length": length, "ppl": entry["ppl"], "tokens": entry["tokens"],
              "cpu_minutes": report["cpu_minutes"]}  # fmt: skip
    for key in ("passkey", "passkey_by_depth", "passkey_nll", "passkey_nll_by_depth", "copy", "copy_nll"):
        if entry.get(key) is not None:
            result[key] = entry[key]
    return result


def _value(cell: dict, wanted: bool) -> str:
    if not wanted:
        return "-"
    if "ppl" not in cell:
        return "error"
    value = f"{cell['ppl']:.2f}" + (f" / {cell['passkey']:.0%}" if "passkey" in cell else "")
    return value + (f" / copy {cell['copy']:.1%}" if "copy" in cell else "")


def row_lengths(screen: dict, row: dict) -> list[int]:
    """The lengths a row is evaluated at: its own `lengths` (a subset of the screen's), or all of the screen's."""
    lengths = row.get("lengths", screen["lengths"])
    if not set(lengths) <= set(screen["lengths"]):
        raise SystemExit(f"error: row {row['label']!r} asks for lengths {lengths}, not all in {screen['lengths']}")
    return lengths


def table(screen: dict, cells: list[dict]) -> str:
    wanted = {(row["label"], t, n) for row in screen["rows"] for t in screen["texts"] for n in row_lengths(screen, row)}
    columns = [(text, length) for text in screen["texts"] for length in screen["lengths"]]
    found = {(c["row"], c["text"], c["length"]): c for c in cells}
    lines = ["| row | training tokens | " + " | ".join(f"{t} {n}" for t, n in columns) + " | CPU min |"]
    lines.append("|---|---:|" + "---:|" * len(columns) + "---:|")
    for row in screen["rows"]:
        got = [found.get((row["label"], t, n), {}) for t, n in columns]
        values = [_value(c, (row["label"], t, n) in wanted) for c, (t, n) in zip(got, columns, strict=True)]
        minutes = sum(c.get("cpu_minutes", 0) for c in got)
        lines.append(
            f"| {row['label']} | {row.get('training_tokens', 0):,} | " + " | ".join(values) + f" | {minutes:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("screen", type=Path, help="the screen's YAML file (examples/smollm2/screens/)")
    parser.add_argument("--output", type=Path, required=True, help="folder of the cells, screen.json and screen.md")
    parser.add_argument("--smollm2", type=Path, default=ROOT / "runs" / "smollm2", help="make smollm2's output")
    parser.add_argument(
        "--band", type=Path, default=ROOT / "runs" / "band" / "train" / "final", help="the critical-band run's model"
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="evaluations at once (default: cores)")
    args = parser.parse_args(argv)
    screen = yaml.safe_load(args.screen.read_text())
    out = args.output.resolve()
    (out / "cells").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    models = {}
    for row in screen["rows"]:
        model = resolve(row["model"], args.smollm2.resolve(), args.band.resolve())
        if row.get("config"):
            model = variant(model, row["config"], out / "models" / slug(row["label"]))
        models[row["label"]] = model
    jobs = [(row, text, n) for row in screen["rows"] for text in screen["texts"] for n in row_lengths(screen, row)]
    with ThreadPoolExecutor(args.jobs) as pool:
        cells = list(pool.map(lambda job: cell(*job, screen, out, models[job[0]["label"]]), jobs))
    protocol = {key: screen[key] for key in ("texts", "lengths", "max_tokens", "train_length")}
    retrieval = ("passkey_trials", "passkey_depths", "copy_trials", "copy_span")
    protocol.update({key: screen[key] for key in retrieval if key in screen})
    protocol["texts"] = {text: TEXTS[text] for text in screen["texts"]}
    result = {"screen": os.path.relpath(args.screen.resolve(), ROOT), "protocol": protocol, "rows": screen["rows"]}
    result["models"] = models
    result["cells"] = cells
    (out / "screen.json").write_text(json.dumps(result, indent=2) + "\n")
    markdown = table(screen, cells)
    (out / "screen.md").write_text(markdown)
    print(markdown)
    return 1 if any("error" in c for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
