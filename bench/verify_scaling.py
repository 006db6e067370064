"""Does `path-hf convert --verify` scale? Exact conversions of deep, wide models must pass and wrong ones fail.

    OMP_NUM_THREADS=2 python bench/verify_scaling.py --smollm2 /work/cache/smollm2-hf    # + 4 Llama-3-8B layers
    python bench/verify_scaling.py --layers 2                                          # the synthetic model only

Sources: SmolLM2-135M when `--smollm2 DIR` is given (a float32 safetensors export), and a Llama-3-8B-shaped model
with `--layers` layers (hidden 4096, 32 heads, 8 kv heads, head dim 128, intermediate 14336, vocab 128256, llama3
RoPE scaling with theta 500000, untied head, bf16) with random weights at realistic scales: matrices N(0, 0.02^2)
(the config's `initializer_range`, the order of trained Llama weights), RMSNorm weights N(1, 0.1^2), and a head of
N(0, 0.04^2), which gives logits with a std of about 64 * 0.04 = 2.6, a trained model's order; its tokenizer is a
word-level one of the built-in verification text, so --verify runs on 256 tokens as it does for a real model.

For each source, each in a fresh process:
- `path-hf convert --rope keep --init identity --verify`, by its function (`convert`): its verdict and
  `max |diff| / std(source logits)` in float64, read from the result it returns, the time of the verify phase (from
  its first printed line to the end) and the process's peak RSS (`wait4`);
- the old check: both models in float32 (as --verify ran before), their max |diff| (old limit 1e-4) and that
  difference over the logits' std;
- two wrong conversions, which must fail: layers 0 and 1's k_proj swapped, and layer 1's k_proj perturbed by
  1e-3 of its RMS (the achieved change after rounding to the stored dtype is printed); their difference and the
  first output that differs are read from the result that `VerificationFailed` holds.
Writes a Markdown table to stdout and JSON to bench/out/. Everything is written under a temporary directory in
--workdir and deleted at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=False,
)
MATRIX_STD, NORM_STD, HEAD_STD = 0.02, 0.1, 0.04
OLD_TOLERANCE = 1e-4  # the float32 max abs difference --verify allowed before
PERTURBATION = 1e-3
SWAPPED = ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.k_proj.weight")
PERTURBED = "model.layers.1.self_attn.k_proj.weight"
VERIFY_OPTIONS = dict(rope="keep", init="identity", verify=True)  # --rope keep --init identity --verify


def write_synthetic_checkpoint(directory: Path, num_layers: int) -> None:
    """The Llama-3-8B-shaped source, written tensor by tensor (2 GB shards), with a word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    from path_hf.conversion.architectures import ARCHITECTURES, converted_layout, path_config_from
    from path_hf.conversion.io import SafetensorsWriter, TensorMeta, shard_file_names, split_into_shards, write_index
    from path_hf.conversion.options import parse_size
    from path_hf.conversion.verify import TEXT_FILE

    config = LlamaConfig(**LLAMA3_8B, num_hidden_layers=num_layers, dtype="bfloat16")
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(directory)
    layout = converted_layout(path_config_from(config, ARCHITECTURES["LlamaForCausalLM"]))
    tensors = [TensorMeta(name, torch.bfloat16, shape) for name, shape in layout.source.items()]
    shards = split_into_shards(tensors, parse_size("2GB"))
    names = shard_file_names(len(shards))
    generator = torch.Generator().manual_seed(0)
    for shard, name in zip(shards, names, strict=True):
        with SafetensorsWriter(directory / name, shard) as writer:
            for tensor in shard:
                data = torch.randn(tensor.shape, generator=generator)
                if tensor.name.endswith("norm.weight"):
                    data = 1 + NORM_STD * data
                else:
                    data *= HEAD_STD if tensor.name == "lm_head.weight" else MATRIX_STD
                writer.write_tensor(tensor, data.to(torch.bfloat16))
    if len(shards) > 1:
        write_index(directory, shards, names)

    words = sorted(set(re.findall(r"\w+|[^\w\s]", TEXT_FILE.read_text())))
    backend = Tokenizer(models.WordLevel({"<unk>": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(directory)


def float32_check(source: Path, converted: Path) -> None:
    """Print, as JSON, what the old check measured: both models in float32, max |diff|, and the logits' std."""
    import torch
    from transformers import AutoConfig

    from path_hf.conversion.io import SourceWeights
    from path_hf.conversion.verify import CheckpointTensors, identity_transforms, streamed_logits, verification_input

    config = AutoConfig.from_pretrained(source)
    input_ids, _ = verification_input(source, config.vocab_size)
    f32 = torch.float32
    reference = streamed_logits(
        config, CheckpointTensors(SourceWeights.from_directory(source), dtype=f32), input_ids, dtype=f32
    )
    logits = streamed_logits(
        AutoConfig.from_pretrained(converted, rope_mode="keep"),
        CheckpointTensors(SourceWeights.from_directory(converted), dtype=f32),
        input_ids,
        prepare_layer=identity_transforms,
        dtype=f32,
    )
    max_diff = (logits - reference).abs().max().item()
    print(json.dumps({"max_abs_diff": max_diff, "logits_std": reference.std().item()}))


def edit_in_place(directory: Path, names: tuple[str, ...], edit) -> None:
    """Replace tensors `names` of the safetensors checkpoint in `directory` by `edit(*tensors)`, byte for byte."""
    import torch

    from path_hf.conversion.io import SourceReader, read_safetensors_header

    found = {
        tensor.name: tensor for file in directory.glob("*.safetensors") for tensor in read_safetensors_header(file)
    }
    with SourceReader() as reader:
        old = [reader.tensor(found[name]).clone() for name in names]
    for name, data in zip(names, edit(*old), strict=True):
        meta = found[name]
        assert (data.dtype, tuple(data.shape)) == (meta.dtype, meta.shape)
        with open(meta.file, "r+b") as file:
            file.seek(meta.offset)
            file.write(data.contiguous().view(torch.uint8).numpy().tobytes())


def perturb(tensor, achieved: list[float]):
    """`tensor` plus noise of `PERTURBATION` times its RMS, rounded to its dtype; prints the change achieved, and
    appends it to `achieved`."""
    import torch

    noise = torch.randn(tensor.shape, generator=torch.Generator().manual_seed(1))
    rms = tensor.float().square().mean().sqrt()
    perturbed = (tensor.float() + PERTURBATION * rms * noise).to(tensor.dtype)
    change = ((perturbed.float() - tensor.float()).square().mean().sqrt() / rms).item()
    print(f"perturbed {PERTURBED} by {change:.3g} of its RMS", flush=True)
    achieved.append(change)
    return (perturbed,)


def convert_and_report(kind: str, source: Path, output: Path) -> int:
    """`path-hf convert --from SOURCE --to OUTPUT --rope keep --init identity --verify` in this process, by
    `convert`, with the written checkpoint made wrong before it is verified unless `kind` is "exact"; prints, as
    JSON on its last line, what the verification measured and the perturbation achieved. Returns the exit code."""
    import path_hf.conversion.convert
    from path_hf.conversion.options import ConvertOptions
    from path_hf.conversion.verify import VerificationFailed

    write_conversion = path_hf.conversion.convert.write_conversion
    achieved: list[float] = []

    def write_then_break(plan, directory):
        write_conversion(plan, directory)
        if kind == "swapped":
            edit_in_place(directory, SWAPPED, lambda first, second: (second, first))
        elif kind == "perturbed":
            edit_in_place(directory, (PERTURBED,), lambda tensor: perturb(tensor, achieved))

    path_hf.conversion.convert.write_conversion = write_then_break
    options = ConvertOptions(source=str(source), output=str(output), **VERIFY_OPTIONS)
    try:
        verification, code = path_hf.conversion.convert.convert(options).verification, 0
    except VerificationFailed as failed:
        print(f"error: {failed}", file=sys.stderr, flush=True)
        verification, code = failed.result, 1
    report = {"verification": dataclasses.asdict(verification), "perturbation": achieved[0] if achieved else None}
    print(json.dumps(report), flush=True)
    return code


def run_measured(command: list[str]) -> dict:
    """Run `command`, a `--convert` of this script: exit code, output, wall seconds, seconds from its first
    `verify:` line to its end, peak RSS, and what it reported (`convert_and_report`)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, verify_start = [], None
    for line in process.stdout:
        lines.append(line)
        if verify_start is None and line.startswith("verify:"):
            verify_start = time.perf_counter()
    _, status, usage = os.wait4(process.pid, 0)
    end = time.perf_counter()
    try:
        report = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise RuntimeError(f"no verification result from {command}:\n{''.join(lines)}") from None
    return {
        "code": os.waitstatus_to_exitcode(status),
        "output": "".join(lines),
        "seconds": end - start,
        "verify_seconds": end - verify_start if verify_start is not None else None,
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        **report,
    }


def measure(name: str, source: Path, workdir: Path) -> dict:
    """The exact conversion, the float32 check and the two wrong conversions of `source`."""
    converted = workdir / "converted"
    exact = run_measured([sys.executable, __file__, "--convert", "exact", str(source), str(converted)])
    if exact["code"] != 0:
        raise RuntimeError(f"--verify failed on the exact conversion of {name}:\n{exact['output']}")
    start = time.perf_counter()
    old = subprocess.run(
        [sys.executable, __file__, "--float32-check", str(source), str(converted)], check=True, capture_output=True
    )
    float32 = json.loads(old.stdout.decode().strip().splitlines()[-1])
    float32["seconds"] = time.perf_counter() - start
    shutil.rmtree(converted)

    result = {"source": name, "exact": exact, "float32": float32}
    for kind in ("swapped", "perturbed"):
        result[kind] = run_measured([sys.executable, __file__, "--convert", kind, str(source), str(converted)])
        if result[kind]["code"] == 0 or converted.exists():
            raise RuntimeError(f"--verify passed the {kind} conversion of {name}:\n{result[kind]['output']}")
    print(f"{name}: measured", file=sys.stderr, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--smollm2", type=Path, help="SmolLM2-135M checkpoint directory (skipped if not given)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the Llama-3-8B-shaped model; 0 skips it")
    parser.add_argument("--workdir", default=tempfile.gettempdir(), help="where to write (default: %(default)s)")
    parser.add_argument("--write-source", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--float32-check", nargs=2, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--convert", nargs=3, metavar=("KIND", "SOURCE", "OUTPUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_source:
        write_synthetic_checkpoint(args.write_source, args.layers)
        return
    if args.float32_check:
        float32_check(*args.float32_check)
        return
    if args.convert:
        kind, source, output = args.convert
        sys.exit(convert_and_report(kind, Path(source), Path(output)))

    load = os.getloadavg()[0]
    results = []
    workdir = Path(tempfile.mkdtemp(prefix="path-hf-verify-scaling-", dir=args.workdir))
    try:
        if args.smollm2:
            results.append(measure("SmolLM2-135M (30 layers, fp32)", args.smollm2, workdir))
        if args.layers:
            source = workdir / "llama3-8b-shaped"
            source.mkdir()
            subprocess.run(
                [sys.executable, __file__, "--write-source", str(source), "--layers", str(args.layers)], check=True
            )
            results.append(measure(f"Llama-3-8B-shaped, {args.layers} layers (bf16)", source, workdir))
            shutil.rmtree(source)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    # Imported only now: a child's peak RSS starts at the size of the process that starts it.
    from path_hf.conversion.options import VERIFY_TOLERANCE

    gib = 2**30
    print(
        f"| source | float32 (old check): max abs diff (limit {OLD_TOLERANCE:g}) | float32: / std | float64 (new "
        f"check): max diff / std (limit {VERIFY_TOLERANCE:g}) | verify phase | peak RSS | swapped k_proj "
        f"(layers 0, 1) | k_proj of layer 1 perturbed by {PERTURBATION:g} of its RMS |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        f32, exact = r["float32"], r["exact"]
        wrong = {
            kind: f"fails: {r[kind]['verification']['difference']:.3g}, first at "
            f"{r[kind]['verification']['first_differing']}"
            for kind in ("swapped", "perturbed")
        }
        old_verdict = "fails" if f32["max_abs_diff"] > OLD_TOLERANCE else "passes"
        print(
            f"| {r['source']} | {f32['max_abs_diff']:.3g} ({old_verdict})"
            f" | {f32['max_abs_diff'] / f32['logits_std']:.3g} (std {f32['logits_std']:.3g}) | "
            f"{exact['verification']['difference']:.3g} (passes) | {exact['verify_seconds']:.0f} s (float32 check: "
            f"{f32['seconds']:.0f} s) | {exact['peak_rss_bytes'] / gib:.2f} GiB | {wrong['swapped']} | "
            f"{wrong['perturbed']} ({r['perturbed']['perturbation']:.2g} achieved) |"
        )
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
    print(f"\n{machine}; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    out_dir = REPO_ROOT / "bench" / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "verify_scaling.json").write_text(json.dumps({"machine": machine, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
