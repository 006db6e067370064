"""Where the time of a recipe step goes on CPU, and align / distill tokens/s before and after isolating the align stage.

    python bench/recipe_cpu.py --teacher SOURCE --student CONVERTED [--block 512] [--batch 1] [--steps 4]

SOURCE is the RoPE model (a checkpoint directory or a .gguf file), CONVERTED its PaTH conversion (`path-hf convert`).
One optimizer-free training step is timed in parts, on random token blocks, after one warm-up step:
- align, whole student ("before"): the teacher's forward with hooks recording each layer's attention input and
  output, the whole student's forward with each PaTH attention fed the teacher's input, the backward;
- align, isolated ("after", what recipes/train.py does on one process or DDP): the teacher's forward, then each PaTH
  attention alone on its recorded input, backpropagated layer by layer;
- distill: the teacher's forward with logits, the student's forward, the backward of the KL.
The PaTH core (`path_attention`'s torch backend) is timed inside the forward, and its forward + backward on the same
shapes on its own. Prints a Markdown table (seconds per step, tokens/s, the ratio to "before" measured in the same run).

`--ops-before COMMIT` (repeatable) also times every case but `core` with path_hf.ops as it was at that commit
(`path_hf/ops.py` and the files it imports relatively, read with `git show`, loaded as a package of their own),
labelled `case@COMMIT`: e.g. `align-whole@8aac2a5`, the whole-model align case with the ops of commit 8aac2a5. Each
row's ratio is against the first row of its stage (align or distill) in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from ops_versions import load_ops_at

from path_hf import modeling_path_llama, ops
from path_hf.evaluation import IGNORE_INDEX
from path_hf.recipes.losses import AttentionAlignment
from path_hf.recipes.models import select_trainable
from path_hf.recipes.settings import TrainingSettings


class CoreTimer:
    """Accumulates the wall time spent in the torch backend's PaTH attention forward (of `module`, ops by default)."""

    module = ops
    # The torch backend's function: the name in ops.py that path_attention calls (at older commits, the second).
    BACKEND_NAMES = ("chunk_path_attention", "_chunked_path_attention")

    def __init__(self):
        self.seconds = 0.0
        self._name = next(name for name in self.BACKEND_NAMES if hasattr(self.module, name))
        self._original = getattr(self.module, self._name)

    def __enter__(self) -> CoreTimer:
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return self._original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        setattr(self.module, self._name, timed)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.module, self._name, self._original)


@contextlib.contextmanager
def ops_at(commit: str):
    """The PaTH layers run `path_attention` of path_hf.ops as it was at `commit`, within this context."""
    old = load_ops_at(commit)
    current = modeling_path_llama.path_attention
    modeling_path_llama.path_attention, CoreTimer.module = old.path_attention, old
    try:
        yield
    finally:
        modeling_path_llama.path_attention, CoreTimer.module = current, ops


def load(path: str, dtype: torch.dtype):
    import path_hf  # noqa: F401  (registers path_llama)
    from path_hf.loading import load_causal_lm

    return load_causal_lm(path, dtype=dtype)


def random_batch(vocab: int, batch: int, block: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, block), generator=generator)
    labels = input_ids.clone()
    labels[:, 0] = IGNORE_INDEX
    return {"input_ids": input_ids, "position_ids": torch.arange(block).expand(batch, -1), "labels": labels}


def align_step(student, teacher, alignment, batch) -> dict[str, float]:
    times = {}
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    with alignment.aligning(), CoreTimer() as core:
        started = time.perf_counter()
        with torch.no_grad():
            teacher(**inputs, logits_to_keep=1)
        times["teacher forward"] = time.perf_counter() - started
        started = time.perf_counter()
        if alignment.isolated:  # forward and backward interleave layer by layer: time them apart with the graph
            forward, backward = 0.0, 0.0
            for idx, attention in sorted(alignment.layers.items()):
                begin = time.perf_counter()
                out = attention(**alignment.recorded_input(idx, torch.float32), position_ids=batch["position_ids"])
                loss = torch.nn.functional.mse_loss(out[0], alignment.targets[idx]) / len(alignment.layers)
                middle = time.perf_counter()
                loss.backward()
                forward, backward = forward + middle - begin, backward + time.perf_counter() - middle
            times["student forward"], times["backward"] = forward, backward
        else:
            student(**inputs, logits_to_keep=1)
            times["student forward"] = time.perf_counter() - started
            loss = torch.stack([alignment.layer_loss(i) for i in sorted(alignment.outputs)]).mean()
            started = time.perf_counter()
            loss.backward()
            times["backward"] = time.perf_counter() - started
        times["PaTH core forward"] = core.seconds
    student.zero_grad(set_to_none=True)
    return times


def distill_step(student, teacher, batch) -> dict[str, float]:
    times = {}
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    with CoreTimer() as core:
        started = time.perf_counter()
        with torch.no_grad():
            teacher_logits = teacher(**inputs).logits[:, :-1].float()
        times["teacher forward"] = time.perf_counter() - started
        started = time.perf_counter()
        student_logits = student(**inputs).logits[:, :-1].float()
        loss = torch.nn.functional.kl_div(
            student_logits.log_softmax(-1).flatten(0, 1),
            teacher_logits.log_softmax(-1).flatten(0, 1),
            log_target=True,
            reduction="batchmean",
        )
        times["student forward"] = time.perf_counter() - started
        times["PaTH core forward"] = core.seconds
    started = time.perf_counter()
    loss.backward()
    times["backward"] = time.perf_counter() - started
    student.zero_grad(set_to_none=True)
    return times


def core_alone(config, batch: int, block: int, reps: int) -> float:
    """Forward + backward of the PaTH core alone on one layer's shapes, times the number of PaTH layers."""
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    generator = torch.Generator().manual_seed(0)

    def tensor(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_()

    q, k, v = tensor(batch, block, heads, dim), tensor(batch, block, kv_heads, dim), tensor(batch, block, kv_heads, dim)
    w = torch.nn.functional.normalize(torch.randn(batch, block, kv_heads, dim, generator=generator), dim=-1)
    w.requires_grad_()
    beta = torch.rand(batch, block, kv_heads, generator=generator).requires_grad_()
    g = (
        (-0.05 * torch.rand(batch, block, heads, generator=generator)).requires_grad_()
        if config.path_forget_gate
        else None
    )
    seconds = []
    for _ in range(reps + 1):
        started = time.perf_counter()
        out, _ = ops.path_attention(q, k, v, w, beta, g, backend="torch")
        out.sum().backward()
        seconds.append(time.perf_counter() - started)
    layers = sum(config.is_path_layer(i) for i in range(config.num_hidden_layers))
    return statistics.median(seconds[1:]) * layers


def measure(step, steps: int) -> dict[str, float]:
    step()  # warm-up
    runs = [step() for _ in range(steps)]
    return {part: statistics.median(run[part] for run in runs) for part in runs[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", required=True, help="the RoPE source: a checkpoint directory or a .gguf file")
    parser.add_argument("--student", required=True, help="its PaTH conversion (a directory)")
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per case (after one warm-up)")
    parser.add_argument("--trainable", default="attention", choices=("path", "attention"))
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--teacher-dtype", default="float32", choices=("float32", "bfloat16"), help="the recipe's model.teacher_dtype"
    )
    parser.add_argument(
        "--student-autocast",
        action="store_true",
        help="the student's forward under bfloat16 autocast (accelerate's --mixed_precision bf16); the PaTH core "
        "still computes in float32",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="the student recomputes its decoder layers' activations in backward (training.activation_checkpointing)",
    )
    parser.add_argument("--cases", default="align-whole,align-isolated,distill,core")
    parser.add_argument(
        "--ops-before", metavar="COMMIT", action="append", help="also time the cases with path_hf.ops of COMMIT"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    teacher = load(args.teacher, getattr(torch, args.teacher_dtype)).eval().requires_grad_(False)
    student = load(args.student, torch.float32)
    if args.activation_checkpointing:
        student.activation_checkpointing_enable()
    select_trainable(student, TrainingSettings(output_dir=".", trainable=args.trainable))
    student.train()
    tokens = args.batch * args.block
    batch = random_batch(student.config.vocab_size, args.batch, args.block, seed=0)
    cases = args.cases.split(",")
    results: dict[str, dict[str, float]] = {}
    versions = [(f"@{commit}", lambda c=commit: ops_at(c)) for commit in args.ops_before or []]
    versions.append(("", contextlib.nullcontext))
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=args.student_autocast)
    for suffix, context in versions:
        with context(), autocast:
            for isolated, case in ((False, "align-whole"), (True, "align-isolated")):
                if case in cases:
                    alignment = AttentionAlignment(student, teacher, isolated=isolated)
                    step = lambda a=alignment: align_step(student, teacher, a, batch)  # noqa: E731
                    results[case + suffix] = measure(step, args.steps)
                    for hooks in (teacher.get_decoder().layers, student.get_decoder().layers):  # drop its hooks
                        for layer in hooks:
                            layer.self_attn._forward_pre_hooks.clear()
                            layer.self_attn._forward_hooks.clear()
            if "distill" in cases:
                results["distill" + suffix] = measure(lambda: distill_step(student, teacher, batch), args.steps)
    print(
        f"\nblock {args.block}, batch {args.batch}, trainable {args.trainable}, teacher {args.teacher_dtype}, "
        f"student autocast {'bfloat16' if args.student_autocast else 'off'}, "
        f"activation checkpointing {'on' if args.activation_checkpointing else 'off'}, "
        f"{torch.get_num_threads()} threads, "
        f"median of {args.steps} steps; seconds per step"
    )
    parts = ["teacher forward", "student forward", "backward", "PaTH core forward"]
    print("| case | " + " | ".join(parts) + " | total | tokens/s | vs the stage's first row |")
    print("|---|" + "---:|" * (len(parts) + 3))
    first: dict[str, float] = {}  # the first total of each stage
    for case, times in results.items():
        total = times["teacher forward"] + times["student forward"] + times["backward"]
        before = first.setdefault(case.split("-")[0].split("@")[0], total)
        ratio = f"{before / total:.2f}x"
        cells = " | ".join(f"{times[part]:.2f}" for part in parts)
        print(f"| {case} | {cells} | {total:.2f} | {tokens / total:.0f} | {ratio} |")
    if "core" in cases:
        seconds = core_alone(student.config, args.batch, args.block, args.steps)
        print(f"\nPaTH core alone, forward + backward over every PaTH layer: {seconds:.2f} s per step")


if __name__ == "__main__":
    main()
