# Copyright 2026 The path-hf authors. Apache-2.0.
"""The whole story on the embedded default model, on CPU: `make demo` runs this.

1. `path-hf convert` turns examples/default_model (a 4M-parameter RoPE Llama trained at 256 tokens) into PaTH.
2. `accelerate launch recipes/train.py` recovers it with the recipe recipes/configs/tiny-cpu.yaml (distilling from the
   source), tracking perplexity against the source's (`recovery.png`).
3. `path-hf eval` measures held-out perplexity at 1x, 2x, 4x and 8x the training length for the source with plain
   RoPE, with YaRN and with dynamic NTK scaling, the converted model at step 0 and the recovered PaTH model
   (`ppl_vs_length.png`).
4. A summary table, the goals met or missed, and `demo.json` with every number.

```
python examples/demo.py                          # what `make demo` runs; output in runs/demo
python examples/demo.py --rope keep --forget-gate --output runs/demo-keep-gate
python examples/demo.py --quick                  # a reduced run of the same pipeline (the CI test)
```
Each step is the command a user would type; they are printed as they run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from path_hf.configuration_path_llama import ROPE_MODES

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "examples" / "default_model"
RECIPE = ROOT / "recipes" / "configs" / "tiny-cpu.yaml"
MULTIPLES = (1, 2, 4, 8)
BIN = Path(sys.executable).parent
# The goals of the demo: recovery within 2% of the source at the training length with at most 5% of the
# source's pretraining tokens; at 4x the training length, PaTH within 1.2x of its own 1x perplexity, RoPE above 2x.
RECOVERY_GOAL, TOKEN_SHARE_GOAL = 1.02, 0.05
PATH_EXTRAPOLATION_GOAL, ROPE_BREAK_GOAL = 1.2, 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "demo", help="run directory (replaced)")
    parser.add_argument("--rope", choices=ROPE_MODES, help="RoPE in the PaTH model (default: the recipe's)")
    parser.add_argument(
        "--forget-gate", action=argparse.BooleanOptionalAction, help="PaTH-FoX forget gate (default: the recipe's)"
    )
    parser.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens per length (default: 16384)")
    parser.add_argument("--threads", type=int, help="torch threads of each step (default: torch's choice)")
    parser.add_argument(
        "--quick", action="store_true", help="tiny token budgets and evaluation: checks the pipeline, not the model"
    )
    return parser.parse_args(argv)


def tool(name: str, module: str) -> list[str]:
    """The console script `name` of this Python's environment (what a user types), or `python -m module`."""
    script = BIN / name
    return [str(script)] if script.is_file() else [sys.executable, "-m", module]


def run(command: list[str], env_threads: int | None) -> None:
    """Run one step, echoing it; stop the demo with its exit code if it fails."""
    shown = " ".join(str(part) for part in command).replace(f"{BIN}/", "").replace(sys.executable, "python")
    print(f"\n$ {shown}", flush=True)
    env = dict(os.environ)
    if env_threads:
        env["OMP_NUM_THREADS"] = str(env_threads)
    completed = subprocess.run([str(part) for part in command], cwd=ROOT, env=env)
    if completed.returncode:
        print(f"demo: this step failed with exit code {completed.returncode}", file=sys.stderr)
        sys.exit(completed.returncode)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    recipe = yaml.safe_load(RECIPE.read_text())
    convert = dict(recipe["model"]["convert"])
    if args.rope is not None:
        convert["rope"] = args.rope
    if args.forget_gate is not None:
        convert["forget_gate"] = args.forget_gate
    source = DEFAULT_MODEL / "checkpoint"
    summary = json.loads((source / "training_summary.json").read_text())
    train_length, pretrain_tokens = summary["train_seq_len"], summary["tokens_seen"]
    out = args.output.resolve()
    converted, trained = out / "converted", out / "train"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.perf_counter()

    # 1. Convert.
    flags = ["--rope", convert["rope"], "--init", convert.get("init", "default")]
    flags += ["--forget-gate"] if convert.get("forget_gate") else []
    run([*tool("path-hf", "path_hf"), "convert", "--from", source, "--to", converted, *flags], args.threads)

    # 2. Recover: the recipe on the converted checkpoint (its teacher is the source it records).
    # The recipe tracks recovery on the same held-out tokens that step 3 evaluates on, with the same functions.
    lengths = [m * train_length for m in MULTIPLES]
    eval_tokens = 2 * lengths[-1] if args.quick else args.eval_tokens
    overrides = [f"model.path={converted}", "model.convert={}", f"training.output_dir={trained}"]
    overrides += [f"data.eval_tokens={eval_tokens}"]
    if args.quick:
        overrides += [f"stages.{i}.tokens=4096" for i in range(len(recipe["stages"]))]
        overrides += ["training.eval_every=1000", "training.save_every=1000"]
    launch = [*tool("accelerate", "accelerate.commands.accelerate_cli"), "launch", "--cpu", "--num_processes", "1"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    run([*launch, ROOT / "recipes" / "train.py", "--config", RECIPE, *overrides], args.threads)
    recovery = json.loads((trained / "recovery.json").read_text())

    # 3. Evaluate every model at 1x..8x the training length.
    models = {
        "RoPE (source)": f"{source}",
        "RoPE + YaRN": f"{source}@yarn",
        "RoPE + dynamic NTK": f"{source}@dynamic",
        "PaTH, step 0": f"{converted}",
        "PaTH, recovered": f"{trained / 'final'}",
    }
    command = [*tool("path-hf", "path_hf"), "eval", "--data", DEFAULT_MODEL / "data" / "eval.jsonl.xz"]
    command += ["--lengths", ",".join(map(str, lengths)), "--max-tokens", str(eval_tokens)]
    command += ["--passkey-trials", "0", "--train-length", str(train_length)]
    command += ["--output", out / "eval.json", "--plot", out / "ppl_vs_length.png"]
    for label, spec in models.items():
        command += ["--model", f"{label}={spec}"]
    run(command, args.threads)
    evaluation = json.loads((out / "eval.json").read_text())

    # 4. Summary.
    ppl = {label: {int(n): e["ppl"] for n, e in r["lengths"].items()} for label, r in evaluation["models"].items()}
    source_1x, start_1x, end_1x = (
        ppl[label][train_length] for label in ("RoPE (source)", "PaTH, step 0", "PaTH, recovered")
    )
    training_tokens = recovery["final"]["tokens"]
    goals = {
        "recovery_ratio_1x": end_1x / source_1x,
        "recovery_goal": RECOVERY_GOAL,
        "training_tokens": training_tokens,
        "token_share": training_tokens / pretrain_tokens,
        "token_share_goal": TOKEN_SHARE_GOAL,
        "path_4x_over_1x": ppl["PaTH, recovered"][4 * train_length] / end_1x,
        "path_goal": PATH_EXTRAPOLATION_GOAL,
        "rope_4x_over_1x": ppl["RoPE (source)"][4 * train_length] / source_1x,
        "rope_goal": ROPE_BREAK_GOAL,
    }
    # The same ratio for the tokens read with more context than any in training: the second half of the 4x windows.
    second_half = {
        label: r["lengths"][str(4 * train_length)]["ppl_second_half"] for label, r in evaluation["models"].items()
    }
    goals["path_4x_second_half_over_1x"] = second_half["PaTH, recovered"] / end_1x
    goals["rope_4x_second_half_over_1x"] = second_half["RoPE (source)"] / source_1x
    goals["recovery_met"] = goals["recovery_ratio_1x"] <= RECOVERY_GOAL and goals["token_share"] <= TOKEN_SHARE_GOAL
    goals["extrapolation_met"] = goals["path_4x_over_1x"] <= PATH_EXTRAPOLATION_GOAL
    goals["rope_breaks"] = goals["rope_4x_over_1x"] > ROPE_BREAK_GOAL
    report = {
        "conversion": convert,
        "quick": args.quick,
        "train_length": train_length,
        "source_pretraining_tokens": pretrain_tokens,
        "goals": goals,
        "perplexity": {label: {str(n): v for n, v in values.items()} for label, values in ppl.items()},
        "recovery": recovery,
        "evaluation": evaluation,
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "demo.json").write_text(json.dumps(report, indent=2) + "\n")
    print(summary_text(report, source_1x, start_1x, end_1x))
    return 0


def summary_text(report: dict, source_1x: float, start_1x: float, end_1x: float) -> str:
    goals, n = report["goals"], report["train_length"]
    lines = [
        "",
        f"== path-hf demo: the default model converted to PaTH (rope={report['conversion']['rope']}, "
        f"forget gate {'on' if report['conversion'].get('forget_gate') else 'off'}) ==",
        "",
        f"held-out perplexity at the training length ({n} tokens):",
        f"  source (RoPE)           {source_1x:8.2f}",
        f"  converted, step 0       {start_1x:8.2f}   ratio {start_1x / source_1x:5.2f}",
        f"  recovered               {end_1x:8.2f}   ratio {end_1x / source_1x:5.2f}   after "
        f"{goals['training_tokens']:,} tokens ({goals['token_share']:.1%} of the source's pretraining)",
        "",
        "| model | " + " | ".join(f"{m}x ({m * n})" for m in MULTIPLES) + " | 4x / 1x |",
        "|---|" + "---:|" * (len(MULTIPLES) + 1),
    ]
    for label, values in report["perplexity"].items():
        cells = [f"{values[str(m * n)]:.2f}" for m in MULTIPLES]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {values[str(4 * n)] / values[str(n)]:.2f} |")
    met = {True: "met", False: "MISSED"}
    lines += [
        "",
        f"recovery: ratio {goals['recovery_ratio_1x']:.3f} at 1x with {goals['token_share']:.1%} of the pretraining "
        f"tokens (goal <= {RECOVERY_GOAL} with <= {TOKEN_SHARE_GOAL:.0%}): {met[goals['recovery_met']]}",
        f"extrapolation: PaTH 4x/1x {goals['path_4x_over_1x']:.2f} (goal <= {PATH_EXTRAPOLATION_GOAL}): "
        f"{met[goals['extrapolation_met']]}; RoPE 4x/1x {goals['rope_4x_over_1x']:.2f} (goal > {ROPE_BREAK_GOAL}): "
        f"{met[goals['rope_breaks']]}",
        f"  tokens at positions {2 * n}-{4 * n - 1} of the 4x windows only, over 1x: PaTH "
        f"{goals['path_4x_second_half_over_1x']:.2f}, RoPE {goals['rope_4x_second_half_over_1x']:.2f}",
        "",
        f"written to {report['evaluation']['models']['PaTH, recovered']['path'].rsplit('/train/', 1)[0]}: demo.json, "
        "ppl_vs_length.png, train/recovery.png, train/final (the PaTH model), converted (step 0)",
        f"({report['seconds']:.0f} s)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
