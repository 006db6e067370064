"""GPU benchmark on one CUDA device; lab/gpu/run.sh installs the wheels and runs it (sized for 8 minutes on one H200).

    python -m lab.gpu.gpu_bench [--sections ops,train,decode,smollm2] [--budget-s 450] [--fla-budget-s 100] \
        [--gguf SmolLM2-135M-Instruct.Q4_1.gguf] [--dry-run-cpu]

(a) ops:    path_attention(backend="fla") against backend="torch" in bf16 and fp32. Parity: max abs and relative
            (rms of the difference over rms of the reference) difference of the output and of every gradient,
            against the torch backend run on fp32 copies of the inputs. Time (median of CUDA-event timings) and
            peak memory of forward and forward+backward, with RoPE + causal SDPA on the same shape for scale.
(b) train:  training tokens/s at 4K context in bf16 (parameters and AdamW in bf16, as FLA's own throughput
            benchmark does) of a ~1B PaTHLlamaForCausalLM (FLA backend), LlamaForCausalLM (SDPA) and FLA's
            PaTHAttentionForCausalLM (fla.models, its default fused norm/SwiGLU/cross-entropy) of the same sizes.
(c) decode: greedy generate tokens/s of the same three models with their caches, decode steps only.
(d) smollm2: SmolLM2-135M-Instruct from its GGUF, converted (RoPE interleaved with PaTH, forget gate), recovered
            (align and distill at 512- and 2048-token blocks, then distill at 8192; bf16, FLA) for as many tokens as
            the time left allows, and evaluated at 512-32768 tokens, as it is and with YaRN, on two held-out texts
            next to the source, YaRN and dynamic NTK (lab/gpu/gpu_smollm2.py). Its conversion runs on the CPU while
            (a)-(c) hold the GPU.

(a)-(c) share `--fla-budget-s`, and everything ends within `--budget-s`: a part that would overrun is skipped and
recorded, as is one that fails. The results are written after each part to $OUT (or runs/gpu) as gpu_bench.json and
gpu_bench.md. `--dry-run-cpu` runs (d) alone on the CPU (torch backend, float32, a few steps, short lengths).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from lab.gpu.gpu_smollm2 import DRY_RUN_CPU, GPU, SmolLM2Run
from lab.gpu.gpu_smollm2 import markdown as smollm2_markdown
from path_hf.ops import path_attention

OUT = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[2] / "runs" / "gpu")  # runs/gpu
DEVICE = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


Attempt = Callable[[str, Callable[[], object]], object]  # runs a part, records its error, returns None on failure


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def check(self, what: str, needs: float = 0.0) -> None:
        if self.left() < needs:
            raise TimeoutError(f"skipped {what}: {self.left():.0f} s left of the budget, needs ~{needs:.0f} s")


def cuda_times_ms(fn: Callable[[], object], warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def peak_extra_mib(fn: Callable[[], object]) -> float:
    """Peak CUDA memory allocated while fn runs, above what was allocated before."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


# ---------------------------------------------------------------------------------------------------- (a) ops


def attention_inputs(
    batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, gate: bool
) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=DEVICE, generator=gen)

    inputs = {
        "q": randn(batch, seq_len, heads, head_dim).to(dtype),
        "k": randn(batch, seq_len, kv_heads, head_dim).to(dtype),
        "v": randn(batch, seq_len, kv_heads, head_dim).to(dtype),
        # w, beta and g stay fp32, as FLA requires and as the model computes them
        "w": F.normalize(randn(batch, seq_len, kv_heads, head_dim), dim=-1),
        "beta": 1.9 * torch.sigmoid(randn(batch, seq_len, kv_heads)),
    }
    if gate:
        inputs["g"] = F.logsigmoid(randn(batch, seq_len, heads))
    return inputs


def path_fwd_bwd(
    inputs: dict[str, torch.Tensor], backend: str, grad_out: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    leaves = {n: t.detach().requires_grad_(grad_out is not None) for n, t in inputs.items()}
    o, _ = path_attention(**leaves, backend=backend)
    if grad_out is None:
        return {"o": o}
    grads = torch.autograd.grad(o, list(leaves.values()), grad_out)
    return {"o": o, **{f"d{n}": g for n, g in zip(leaves, grads, strict=True)}}


def diff(a: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    d = (a.float() - ref.float()).flatten()
    rms_ref = ref.float().pow(2).mean().sqrt().item()
    return {"max_abs": d.abs().max().item(), "rel": d.pow(2).mean().sqrt().item() / max(rms_ref, 1e-30)}


def ops_parity(args: argparse.Namespace, attempt: Attempt, rows: list[dict[str, object]]) -> None:
    batch, seq_len, head_dim = 2, args.parity_seq_len, 64
    for heads, kv_heads, gate in ((8, 8, False), (8, 4, True)):
        fp32_inputs = attention_inputs(batch, seq_len, heads, kv_heads, head_dim, torch.float32, gate)
        grad_out = torch.randn(batch, seq_len, heads, head_dim, device=DEVICE)
        reference = attempt("parity reference", lambda i=fp32_inputs, g=grad_out: path_fwd_bwd(i, "torch", g))
        if reference is None:
            continue
        for dtype_name, dtype in DTYPES.items():
            inputs = {n: (t.to(dtype) if n in ("q", "k", "v") else t) for n, t in fp32_inputs.items()}
            case = f"B{batch}-T{seq_len}-HQ{heads}-H{kv_heads}-D{head_dim}{'-gate' if gate else ''}-{dtype_name}"
            grad = grad_out.to(dtype)
            out = {b: attempt(f"parity {case} {b}", partial(path_fwd_bwd, inputs, b, grad)) for b in ("fla", "torch")}
            if None in out.values():
                continue
            for name in reference:
                rows.append(
                    {
                        "case": case,
                        "tensor": name,
                        **{f"fla_vs_ref_{k}": v for k, v in diff(out["fla"][name], reference[name]).items()},
                        **{f"torch_vs_ref_{k}": v for k, v in diff(out["torch"][name], reference[name]).items()},
                        **{f"fla_vs_torch_{k}": v for k, v in diff(out["fla"][name], out["torch"][name]).items()},
                    }
                )


def rope_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    seq_len, head_dim = q.shape[1], q.shape[-1]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=q.device, dtype=torch.float32) / head_dim))
    angles = torch.arange(seq_len, device=q.device, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)[None, :, None, :]
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    q, k, v = (x.transpose(1, 2) for x in (rotate(q), rotate(k), v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def ops_timing(args: argparse.Namespace, budget: Budget, attempt: Attempt, rows: list[dict[str, object]]) -> None:
    """Appends to rows as it goes, so a failure or a budget stop keeps what was measured."""
    batch, seq_len, heads, head_dim = args.batch, args.seq_len, args.heads, args.hidden // args.heads
    for dtype_name, dtype in DTYPES.items():
        inputs = attention_inputs(batch, seq_len, heads, heads, head_dim, dtype, gate=False)
        grad_out = torch.randn(batch, seq_len, heads, head_dim, device=DEVICE, dtype=dtype)
        qkv = {n: inputs[n] for n in ("q", "k", "v")}

        def sdpa_fwd_bwd(qkv: dict[str, torch.Tensor] = qkv, grad_out: torch.Tensor = grad_out) -> object:
            leaves = [t.detach().requires_grad_() for t in qkv.values()]
            return torch.autograd.grad(rope_sdpa(*leaves), leaves, grad_out)

        methods: dict[str, dict[str, Callable[[], object]]] = {
            "sdpa+rope": {"fwd": lambda qkv=qkv: rope_sdpa(**qkv), "fwd+bwd": sdpa_fwd_bwd},
        }
        for backend in ("fla", "torch"):
            methods[f"path-{backend}"] = {
                "fwd": lambda b=backend, i=inputs: path_fwd_bwd(i, b),
                "fwd+bwd": lambda b=backend, i=inputs, g=grad_out: path_fwd_bwd(i, b, g),
            }
        shape = f"B{batch}-T{seq_len}-H{heads}-D{head_dim}"
        for method, modes in methods.items():
            for mode, fn in modes.items():
                what = f"ops timing {method} {mode} {dtype_name}"
                row = attempt(what, partial(time_attention, fn, mode, args.reps, budget, what))
                if row is not None:
                    rows.append({"shape": shape, "dtype": dtype_name, "method": method, **row})


def time_attention(fn: Callable[[], object], mode: str, reps: int, budget: Budget, what: str) -> dict[str, object]:
    budget.check(what, needs=20)
    with torch.no_grad() if mode == "fwd" else torch.enable_grad():
        times = cuda_times_ms(fn, warmup=2, reps=reps)
        memory = peak_extra_mib(fn)
    print(f"  {what}: {statistics.median(times):.2f} ms", flush=True)
    return {"mode": mode, "median_ms": statistics.median(times), "times_ms": times, "peak_extra_mib": memory}


# ------------------------------------------------------------------------------------------------ (b, c) models


def llama_sizes(args: argparse.Namespace) -> dict[str, object]:
    return {
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.heads,
        "vocab_size": args.vocab,
        "max_position_embeddings": max(args.seq_len, args.prompt_len + args.new_tokens),
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "eos_token_id": None,
    }


def build_model(name: str, args: argparse.Namespace) -> torch.nn.Module:
    """A bf16 model on the GPU, randomly initialised. The three share every size."""
    torch.manual_seed(0)
    sizes = llama_sizes(args)
    if name == "llama-sdpa":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**sizes, attn_implementation="sdpa"))
    elif name == "path-llama-fla":
        from path_hf import PaTHLlamaConfig, PaTHLlamaForCausalLM

        config = PaTHLlamaConfig(**sizes, rope_mode="drop", path_backend="fla", path_w_rank=args.w_rank)
        model = PaTHLlamaForCausalLM(config)
    elif name == "fla-path-attn":
        from fla.models import PaTHAttentionConfig, PaTHAttentionForCausalLM

        config = PaTHAttentionConfig(
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_hidden_layers=args.layers,
            num_heads=args.heads,
            vocab_size=args.vocab,
            use_low_rank_w=args.w_rank is not None,
            pad_token_id=0,
            eos_token_id=None,
        )
        model = PaTHAttentionForCausalLM(config)
    else:
        raise ValueError(name)
    return model.to(device=DEVICE, dtype=torch.bfloat16)


def train_throughput(name: str, args: argparse.Namespace, budget: Budget) -> dict[str, object]:
    budget.check(f"train {name}", needs=40)
    model = build_model(name, args).train()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def step() -> torch.Tensor:
        tokens = torch.randint(args.vocab, (args.batch, args.seq_len), device=DEVICE, generator=gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(args.train_warmup):  # Triton autotuning and compilation happen here
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.train_steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    row = {
        "model": name,
        "params": params,
        "tokens_per_s": args.batch * args.seq_len * args.train_steps / seconds,
        "ms_per_step": 1e3 * seconds / args.train_steps,
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
        "final_loss": float(loss),
    }
    return row


def decode_throughput(name: str, args: argparse.Namespace, budget: Budget) -> dict[str, object]:
    budget.check(f"decode {name}", needs=40)
    model = build_model(name, args).eval()
    prompt = torch.randint(1, args.vocab, (args.decode_batch, args.prompt_len), device=DEVICE)

    def generate_s(new_tokens: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )
        torch.cuda.synchronize()
        assert out.shape[1] == args.prompt_len + new_tokens, out.shape
        return time.perf_counter() - start

    generate_s(args.new_tokens)  # warm-up: autotuning, compilation
    full = statistics.median(generate_s(args.new_tokens) for _ in range(args.decode_reps))
    first = statistics.median(generate_s(1) for _ in range(args.decode_reps))
    row = {
        "model": name,
        "decode_tokens_per_s": args.decode_batch * (args.new_tokens - 1) / (full - first),
        "generate_s": full,
        "prefill_plus_first_token_s": first,
    }
    return row


# ------------------------------------------------------------------------------------------------------- report


def markdown(result: dict[str, object]) -> str:
    lines = [f"# GPU benchmark: {result['machine']['gpu']}", "", "```", json.dumps(result["machine"]), "```"]
    if "ops_parity" in result:
        lines += ["", "## (a) Parity against the torch backend on fp32 inputs (relative rms difference)", ""]
        lines += ["| case | tensor | fla vs ref | torch vs ref | fla vs torch | fla vs torch max abs |"]
        lines += ["|---|---|---|---|---|---|"]
        for r in result["ops_parity"]:
            lines.append(
                f"| {r['case']} | {r['tensor']} | {r['fla_vs_ref_rel']:.2e} | {r['torch_vs_ref_rel']:.2e} |"
                f" {r['fla_vs_torch_rel']:.2e} | {r['fla_vs_torch_max_abs']:.2e} |"
            )
    if "ops_timing" in result:
        lines += ["", "## (a) Attention time and peak extra memory", ""]
        lines += ["| shape | dtype | method | mode | ms | vs sdpa+rope | MiB |", "|---|---|---|---|---|---|---|"]
        rows = result["ops_timing"]
        base = {(r["dtype"], r["mode"]): r["median_ms"] for r in rows if r["method"] == "sdpa+rope"}
        for r in rows:
            base_ms = base.get((r["dtype"], r["mode"]))
            ratio = f"{r['median_ms'] / base_ms:.2f}x" if base_ms else "n/a"
            lines.append(
                f"| {r['shape']} | {r['dtype']} | {r['method']} | {r['mode']} | {r['median_ms']:.2f} |"
                f" {ratio} | {r['peak_extra_mib']:.0f} |"
            )
    for title, section, key in (
        ("(b) train tokens/s", "train", "tokens_per_s"),
        ("(c) decode tokens/s", "decode", "decode_tokens_per_s"),
    ):
        rows = result.get(section, [])
        if rows:
            base = next((r[key] for r in rows if r["model"] == "llama-sdpa"), None)
            lines += ["", f"## {title}", "", f"| model | {title[4:]} | vs llama-sdpa |", "|---|---|---|"]
            for r in rows:
                ratio = f"{r[key] / base:.2f}x" if base else "n/a"
                lines.append(f"| {r['model']} | {r[key]:.0f} | {ratio} |")
    if "smollm2" in result:
        lines += smollm2_markdown(result["smollm2"])
    if result["errors"]:
        lines += ["", "## Errors and skips", ""] + [f"- {e.splitlines()[-1]}" for e in result["errors"]]
    return "\n".join(lines) + "\n"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="ops,train,decode,smollm2")
    parser.add_argument("--budget-s", type=float, default=450, help="everything ends within this many seconds")
    parser.add_argument("--fla-budget-s", type=float, default=100, help="no new part of (a)-(c) starts after this")
    parser.add_argument("--gguf", help="(d): SmolLM2-135M-Instruct.Q4_1.gguf (lab/gpu/gpu_carry.py brings it)")
    parser.add_argument(
        "--work-dir", default="/tmp/path-hf-gpu/smollm2", help="(d): converted model, runs, logs (not under $OUT)"
    )
    parser.add_argument(
        "--dry-run-cpu", action="store_true", help="(d) only, on the CPU: torch backend, float32, tiny budget"
    )
    parser.add_argument("--parity-seq-len", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=10)
    # ~1B parameters: Llama-style 2048 hidden, 16 layers, 32 heads of 64, SwiGLU 5632, vocab 32000
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--w-rank", type=int, default=32, help="low-rank w projection, FLA's default; 0: full rank")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--train-warmup", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=10)
    parser.add_argument("--decode-batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--decode-reps", type=int, default=3)
    parser.add_argument("--models", default="llama-sdpa,path-llama-fla,fla-path-attn")
    args = parser.parse_args()
    args.w_rank = args.w_rank or None
    started = time.monotonic()
    sections = args.sections.split(",")
    models = args.models.split(",")
    # run.sh's timeout stops the run with SIGTERM: leave through `finally`, which stops (d)'s processes.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    import transformers

    try:
        import fla

        fla_version = fla.__version__
    except ImportError as e:
        fla_version = f"not importable: {e}"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError as e:
        triton_version = f"not importable: {e}"

    cuda = torch.cuda.is_available() and not args.dry_run_cpu
    result: dict[str, object] = {
        "machine": {
            "gpu": torch.cuda.get_device_name() if cuda else f"none (CPU dry run: {platform.processor() or 'cpu'})",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": triton_version,
            "transformers": transformers.__version__,
            "fla": fla_version,
            **{name: _version(name) for name in ("accelerate", "peft", "datasets", "gguf", "pyarrow", "fsspec")},
            "python": platform.python_version(),
        },
        "args": vars(args),
        "errors": [],
    }
    print(json.dumps(result["machine"]), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (OUT / "gpu_bench.json").write_text(json.dumps(result, indent=2))
        (OUT / "gpu_bench.md").write_text(markdown(result))

    def attempt(what: str, fn: Callable[[], object]) -> object | None:
        try:
            return fn()
        except Exception:  # one failing part must not lose the others' results
            result["errors"].append(f"{what}: {traceback.format_exc()}")
            print(result["errors"][-1], flush=True)
            return None
        finally:
            gc.collect()  # the model of the part that just ran
            torch.cuda.empty_cache()
            save()

    def record_error(message: str) -> None:
        result["errors"].append(message)
        print(message, flush=True)

    smollm2 = None
    if "smollm2" in sections:
        result["smollm2"] = {}

        def start_smollm2() -> SmolLM2Run:
            if not args.gguf or not Path(args.gguf).is_file():
                raise FileNotFoundError(f"no SmolLM2 GGUF ({args.gguf}): send it with lab/gpu/run.sh's calls; skipped")
            run = SmolLM2Run(
                Path(args.gguf),
                Path(args.work_dir),
                OUT,
                DRY_RUN_CPU if args.dry_run_cpu else GPU,
                result["smollm2"],
                record_error,
                save,
            )
            run.start()  # the conversion, on the CPU, while (a)-(c) use the GPU
            return run

        smollm2 = attempt("smollm2", start_smollm2)
    try:
        fla_sections = [section for section in ("ops", "train", "decode") if section in sections]
        if fla_sections and not cuda:
            record_error(f"{', '.join(fla_sections)}: skipped, no CUDA device")
            fla_sections = []
        budget = Budget(min(args.fla_budget_s, args.budget_s))
        if "ops" in fla_sections:
            result["ops_parity"], result["ops_timing"] = [], []
            attempt("ops parity", lambda: ops_parity(args, attempt, result["ops_parity"]))
            attempt("ops timing", lambda: ops_timing(args, budget, attempt, result["ops_timing"]))
        for section, fn in (("train", train_throughput), ("decode", decode_throughput)):
            if section in fla_sections:
                result[section] = []
                for name in models:
                    row = attempt(f"{section} {name}", lambda fn=fn, name=name: fn(name, args, budget))
                    if row:
                        result[section].append(row)
                        print(f"  {section} {name}: {json.dumps(row)}", flush=True)
                save()
        if smollm2 is not None:
            attempt("smollm2", lambda: smollm2.finish(deadline=started + args.budget_s))
    finally:
        if smollm2 is not None:
            smollm2.close()
    result["seconds"] = round(time.monotonic() - started, 1)
    save()
    print(markdown(result))


if __name__ == "__main__":
    main()
