# Copyright 2026 The path-hf authors. Apache-2.0.
"""The measurements of `make smollm2` beyond perplexity, for the source model and the recovered PaTH model:

- the greedy answers to five fixed prompts (SmolLM2-135M-Instruct is an instruct model: its chat template is applied);
- how far bfloat16 inference is from float32 (`precision.py`: max logit difference over the logits' spread, top-1
  agreement, KL) on held-out text;
- lm-eval-harness on the local-file tasks of `examples/lm_eval` (its `lm_eval` command, as a user runs it);
- what the PaTH parameters do, at step 0 and recovered: the mean Householder strength beta (0: the identity, no
  transform) and log forget gate per token of each layer, on held-out text.

```
python examples/smollm2/extras.py --source SmolLM2-135M-Instruct.Q4_1.gguf --recovered runs/smollm2/train/final \
    --output runs/smollm2/extras.json
```
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from precision import precision_drift  # beside this script, which runs as one (its folder is on sys.path)

import path_hf  # noqa: F401  (registers PaTHLlama)
from path_hf.evaluation import read_texts, tokenize_stream
from path_hf.loading import load_causal_lm, load_tokenizer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Give me three tips for staying healthy.",
    "What does the len() function do in Python?",
    "Translate 'good morning' into French.",
)
PRECISION_TEXT = ROOT / "examples" / "default_model" / "data" / "eval.jsonl.xz"
LM_EVAL_TASKS = "pydocs,copyright_does_not_exist"
LM_EVAL_LIMIT = 64  # items per task (of 256; the perplexity tasks have 32 documents): ~15 minutes a model on 2 cores


@torch.no_grad()
def greedy_answers(model_path: str, max_new_tokens: int) -> list[str]:
    """The model's greedy answer to each of `PROMPTS`, the chat template applied, in float32."""
    tokenizer = load_tokenizer(model_path)
    model = load_causal_lm(model_path, torch.float32).eval()
    answers = []
    for prompt in PROMPTS:
        input_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        output = model.generate(
            input_ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
        answers.append(tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True).strip())
    return answers


@torch.no_grad()
def path_parameters(model_path: str, tokens: list[int]) -> dict:
    """Mean beta (`bt_gain`'s output) and mean log forget gate per token (`g_gain`'s) of each layer, on `tokens`."""
    model = load_causal_lm(model_path, torch.float32).eval()
    outputs: dict[str, dict[int, float]] = {"beta": {}, "log_gate": {}}
    hooks = []
    for idx, layer in enumerate(model.get_decoder().layers):
        for name, key in (("bt_gain", "beta"), ("g_gain", "log_gate")):
            if (module := getattr(layer.self_attn, name, None)) is not None:

                def record(module, args, out, idx=idx, key=key):
                    outputs[key][idx] = out.mean().item()

                hooks.append(module.register_forward_hook(record))
    model(input_ids=torch.tensor([tokens]), use_cache=False, logits_to_keep=1)
    for hook in hooks:
        hook.remove()
    report = {}
    for key, values in outputs.items():
        if values:
            layers = [values[i] for i in sorted(values)]
            report[key] = {"mean": sum(layers) / len(layers), "min": min(layers), "max": max(layers), "layers": layers}
    return report


def lm_eval(model_path: str, tasks: str, limit: int | None) -> dict:
    """`lm_eval --model hf ...` on the local tasks, in a process of its own; the metrics of each task.

    Batch size 1: the perplexity tasks score whole documents in windows of the model's 8192 positions, and lm-eval
    forms float32 logits for a whole batch (8 x 8192 x 49152 x 4 bytes = 12.9 GB at batch size 8)."""
    path = Path(model_path)
    # lm-eval reads a GGUF through transformers too: the folder, and the file's name
    model = f"pretrained={path.parent},gguf_file={path.name}" if path.suffix == ".gguf" else f"pretrained={path}"
    with tempfile.TemporaryDirectory() as out:
        command = [str(Path(sys.executable).with_name("lm_eval")), "--model", "hf"]
        command += ["--model_args", f"{model},trust_remote_code=True,dtype=float32", "--device", "cpu"]
        command += ["--include_path", str(ROOT / "examples" / "lm_eval"), "--tasks", tasks, "--batch_size", "1"]
        command += ["--output_path", out] + (["--limit", str(limit)] if limit else [])
        print("$ " + " ".join(command).replace(str(ROOT) + "/", ""), flush=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        subprocess.run(command, check=True, env=env, cwd=ROOT)
        result = json.loads(next(Path(out).rglob("results_*.json")).read_text())
    return {
        task: {key.split(",")[0]: value for key, value in metrics.items() if "_stderr" not in key and key != "alias"}
        for task, metrics in result["results"].items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, help="the source model (checkpoint directory or .gguf file)")
    parser.add_argument("--recovered", required=True, help="the recovered PaTH model (checkpoint directory)")
    parser.add_argument(
        "--step0", help="the converted PaTH model before training: its PaTH parameters are reported too"
    )
    parser.add_argument("--output", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--quick", action="store_true", help="short answers, small windows, few lm-eval items")
    args = parser.parse_args(argv)
    models = {"source": args.source, "recovered": args.recovered}
    report: dict = {"prompts": list(PROMPTS)}
    started = time.perf_counter()

    report["answers"] = {name: greedy_answers(path, 8 if args.quick else 64) for name, path in models.items()}
    for i, prompt in enumerate(PROMPTS):
        print(f"\n> {prompt}")
        for name in models:
            print(f"  {name:>9}: {report['answers'][name][i]!r}")

    length, windows = (128, 1) if args.quick else (2048, 2)
    tokens = tokenize_stream(read_texts([PRECISION_TEXT]), load_tokenizer(args.source), length * windows)
    report["precision"] = {name: precision_drift(path, tokens, length, windows) for name, path in models.items()}
    print("\nbfloat16 against float32 logits (held-out Python docs):")
    for name, drift in report["precision"].items():
        print(
            f"  {name:>9}: max |diff| / spread {drift['max_diff_over_spread']:.3f}, per position "
            f"{drift['mean_max_diff_over_spread']:.3f}, top-1 agreement {drift['top1_agreement']:.4f}, "
            f"KL {drift['kl']:.2e}"
        )

    paths = {"step 0": args.step0} if args.step0 else {}
    report["path_parameters"] = {
        label: path_parameters(path, tokens[:length]) for label, path in {**paths, "recovered": args.recovered}.items()
    }
    print("\nPaTH parameters (mean over layers; beta 0 is the identity):")
    for label, entry in report["path_parameters"].items():
        gate = f", log gate per token {entry['log_gate']['mean']:.5f}" if "log_gate" in entry else ""
        beta = entry["beta"]
        print(f"  {label:>9}: beta {beta['mean']:.3f} (layers {beta['min']:.3f} to {beta['max']:.3f}){gate}")

    limit = 8 if args.quick else LM_EVAL_LIMIT
    report["lm_eval"] = {name: lm_eval(path, LM_EVAL_TASKS, limit) for name, path in models.items()}
    report["lm_eval_limit"] = limit
    report["seconds"] = round(time.perf_counter() - started, 1)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
