"""Peak memory of one distill step: the LM heads run per chunk from the final hidden states, against whole logits.

    python bench/distill_memory.py --teacher SOURCE --student CONVERTED [--block 4096] [--steps 1] [--trainable gate]

SOURCE is the RoPE model (a checkpoint directory or a .gguf file), CONVERTED its PaTH conversion (`path-hf convert`).
Each case is one forward and backward of `distillation_loss` on one random block of `--block` tokens, with activation
checkpointing and `--trainable` as the recipe sets them, in a fresh process of its own (one thread), so that its peak
resident memory (ru_maxrss) is its own:
- `whole-logits`: the two models return their [block, vocabulary] logits and only the KL is chunked (what the recipe
  does under FSDP and DeepSpeed, and did everywhere before);
- `heads-per-chunk`: the heads run inside each recomputed chunk of rows (one process, DDP);
- `heads-per-chunk, mmap threshold N MiB`: the same with glibc's mmap threshold fixed at N MiB (`--thresholds`;
  `MALLOC_MMAP_THRESHOLD_` in the child's environment), so that freed blocks of at least N MiB go back to the system
  (recipes/README.md, "Memory on CPU").
Prints a Markdown table: peak RSS, the peak over the loaded models, seconds (the median of `--steps` steps), and each
ratio to the first case run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def cases(thresholds: list[float]) -> dict[str, tuple[bool, float]]:
    """Case name: (heads per chunk, glibc's mmap threshold in MiB set by `MALLOC_MMAP_THRESHOLD_`, 0 for its own)."""
    named = {"whole-logits": (False, 0.0), "heads-per-chunk": (True, 0.0)}
    return named | {f"heads-per-chunk, mmap threshold {mib:g} MiB": (True, mib) for mib in thresholds}


def measure(args: argparse.Namespace, whole_weights: bool) -> dict:
    import torch

    from path_hf.evaluation import IGNORE_INDEX
    from path_hf.loading import load_causal_lm
    from path_hf.recipes.losses import distillation_loss
    from path_hf.recipes.models import teacher_dtype, trainable_model
    from path_hf.recipes.settings import TrainingSettings

    torch.set_num_threads(1)
    teacher = load_causal_lm(args.teacher, teacher_dtype("auto", torch.device("cpu"))).eval()  # as the recipe
    student = load_causal_lm(args.student, torch.float32)
    training = TrainingSettings(output_dir="unused", trainable=args.trainable, activation_checkpointing=True)
    model = trainable_model(student, training).train()  # checkpointing acts in training mode only
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    input_ids = torch.randint(3, teacher.config.vocab_size, (1, args.block), generator=torch.Generator().manual_seed(0))
    labels = input_ids.clone()
    labels[:, 0] = IGNORE_INDEX
    batch = {"input_ids": input_ids, "position_ids": torch.arange(args.block)[None], "labels": labels}
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        loss = distillation_loss(model, teacher, batch, 2.0, whole_weights=whole_weights)
        loss.backward()
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"peak_gib": peak, "loaded_gib": loaded, "seconds": seconds, "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--student", required=True)
    parser.add_argument("--block", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=1, help="steps per case; the seconds are their median")
    parser.add_argument("--trainable", default="gate", choices=["gate", "path", "attention", "full"])
    parser.add_argument("--thresholds", default="1", help="comma-separated glibc mmap thresholds (MiB), a case each")
    parser.add_argument("--skip", default="", help="comma-separated cases left out (whole-logits, heads-per-chunk)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in a child process
    args = parser.parse_args()
    chosen = cases([float(mib) for mib in args.thresholds.split(",") if mib])
    if args.case:
        print(json.dumps(measure(args, chosen[args.case][0])))
        return
    rows = {}
    for case in [name for name in chosen if name not in args.skip.split(",")]:
        command = [sys.executable, __file__, *sys.argv[1:], "--case", case]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
        if threshold := chosen[case][1]:  # glibc reads it when the process starts
            env["MALLOC_MMAP_THRESHOLD_"] = str(int(threshold * 2**20))
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode:
            sys.exit(f"{case} failed:\n{done.stderr[-3000:]}")
        rows[case] = json.loads(done.stdout.strip().splitlines()[-1])
    base = next(iter(rows.values()))
    print(f"block {args.block}, trainable {args.trainable}, one thread, one process a case\n")
    print("| case | peak RSS (GiB) | over the loaded models (GiB) | seconds | peak ratio | time ratio | loss |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for case, row in rows.items():
        over = row["peak_gib"] - row["loaded_gib"]
        ratios = [f"{row[key] / base[key]:.2f}" for key in ("peak_gib", "seconds")]
        cells = [f"{row['peak_gib']:.2f}", f"{over:.2f}", f"{row['seconds']:.1f}", *ratios, f"{row['loss']:.5f}"]
        print(f"| {case} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
