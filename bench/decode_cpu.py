"""CPU benchmark: greedy decoding with the cache, PaTHLlamaForCausalLM against LlamaForCausalLM of the same sizes.

    python bench/decode_cpu.py                          # hidden 256, 4 layers, 4 heads, vocab 1024, P=512, N=128
    python bench/decode_cpu.py --hidden 576 --intermediate 1536 --layers 30 --heads 9 --kv-heads 3 \
        --vocab 49152 --forget-gate --prompt-lens 512,4096  # SmolLM2-135M's sizes, two contexts
    python bench/decode_cpu.py --checkpoints examples/default_model/checkpoint runs/bench/default-path \
        --prompt-lens 16                                # a source checkpoint against its conversion
    python bench/decode_cpu.py --checkpoints runs/smollm2/download/SmolLM2-135M-Instruct.Q4_1.gguf \
        runs/smollm2/train/final --prompt-lens 512,4096  # the SmolLM2 hybrid of `make smollm2` against its source

Both models are randomly initialised from one LlamaConfig (PaTH adds its own fields on top), or, with
--checkpoints SOURCE CONVERTED, loaded: a RoPE checkpoint and its `path-hf convert` output. They and run
`generate(do_sample=False)` with no EOS, so every run makes exactly N new tokens. Each model runs with the default
dynamic cache, with `cache_implementation="static"`, and with the static cache and its decode step compiled
(`torch.compile` through generate's `compile_config`; the first call, a warm-up, compiles). Decode tokens/s counts
the N - 1 tokens after the first, timed inside generate(N) from the first token's logits to the last one's (a logits
processor stamps each step), so the prompt's prefill, which at long prompts swings more than the whole decode, drops
out; the JSON also keeps (N - 1) / (time of generate(N) - time of generate(1)). Medians of --reps runs after one
warm-up, in one process, the rows' repetitions alternating; ratios are to Llama with the dynamic cache (what `generate`
does by default). Prints a Markdown table, writes JSON to bench/out/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import (
    CompileConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
)

from path_hf import PaTHLlamaConfig, PaTHLlamaForCausalLM
from path_hf.configuration_path_llama import ROPE_MODES
from path_hf.loading import load_causal_lm

# On a shared 2-core machine two OpenMP threads stall whenever another process holds a core: we saw 10x
# slowdowns and fwd slower than fwd+bwd. One thread gives ratios that reproduce.
THREADS_HELP = "torch.set_num_threads; default 1, because 2 threads on a busy 2-core machine give erratic times"


def build_models(args: argparse.Namespace) -> dict[str, PreTrainedModel]:
    sizes = {
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate or 4 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads or args.heads,
        "vocab_size": args.vocab,
        "max_position_embeddings": max(int(length) for length in args.prompt_lens.split(",")) + args.new_tokens,
        "eos_token_id": None,
        "pad_token_id": 0,
    }
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**sizes, attn_implementation="sdpa"))
    path_config = PaTHLlamaConfig(
        **sizes, rope_mode=args.rope_mode, path_forget_gate=args.forget_gate, path_backend="torch"
    )
    path = PaTHLlamaForCausalLM(path_config)
    path_name = f"path-llama (rope_mode={args.rope_mode}{', forget gate' if args.forget_gate else ''})"
    return {"llama (sdpa)": llama.eval(), path_name: path.eval()}


def cache_modes() -> dict[str, dict]:
    """generate() kwargs of each way to run the cache."""
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True  # generate compiles only on accelerators unless told
    return {
        "dynamic": {},
        "static": {"cache_implementation": "static"},
        "static + compiled": {"cache_implementation": "static", "compile_config": compile_config},
    }


def load_models(source: Path, converted: Path) -> dict[str, PreTrainedModel]:
    """A source checkpoint (or GGUF) and its conversion, loaded as `path-hf eval` loads them (float32)."""
    models = {}
    for name, path in (("source", source), ("converted", converted)):
        model = load_causal_lm(str(path), torch.float32)  # a checkpoint, or a GGUF (dequantised)
        model.generation_config.eos_token_id = None  # exactly N new tokens
        models[f"{name} ({path.name})"] = model.eval()
    return models


class StepClock(LogitsProcessor):
    """Stamps the time of each generation step: generate calls it once per new token, after that token's forward."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.stamps.append(time.perf_counter())
        return scores


def generate_seconds(
    model: PreTrainedModel, prompt: torch.Tensor, new_tokens: int, kwargs: dict
) -> tuple[float, float | None]:
    """The seconds of generate(new_tokens), and of its decode steps alone: from the first token's logits to the last
    one's (None for a single token)."""
    clock = StepClock()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            prompt,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
            **kwargs,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] == prompt.shape[1] + new_tokens and len(clock.stamps) == new_tokens, out.shape
    return elapsed, clock.stamps[-1] - clock.stamps[0] if new_tokens > 1 else None


def measure(
    runs: dict[str, tuple[PreTrainedModel, dict]], prompt: torch.Tensor, new_tokens: int, reps: int
) -> dict[str, dict]:
    """Repetitions alternate between the runs (model, generate kwargs), so background load hits them alike."""
    warmup = {name: generate_seconds(model, prompt, new_tokens, kwargs)[0] for name, (model, kwargs) in runs.items()}
    full: dict[str, list[float]] = {name: [] for name in runs}
    decode: dict[str, list[float]] = {name: [] for name in runs}
    first: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, (model, kwargs) in runs.items():
            full_s, decode_s = generate_seconds(model, prompt, new_tokens, kwargs)
            full[name].append(full_s)
            decode[name].append(decode_s)
            first[name].append(generate_seconds(model, prompt, 1, kwargs)[0])
    rows = {}
    for name, (model, _) in runs.items():
        full_s, first_s = statistics.median(full[name]), statistics.median(first[name])
        rows[name] = {
            "params": sum(p.numel() for p in model.parameters()),
            "warmup_generate_s": warmup[name],
            "generate_s": full_s,
            "prefill_plus_first_token_s": first_s,
            "decode_tokens_per_s": prompt.shape[0] * (new_tokens - 1) / statistics.median(decode[name]),
            "decode_tokens_per_s_by_difference": prompt.shape[0] * (new_tokens - 1) / (full_s - first_s),
            "end_to_end_tokens_per_s": prompt.shape[0] * new_tokens / full_s,
            "generate_s_all": full[name],
            "decode_s_all": decode[name],
            "prefill_plus_first_token_s_all": first[name],
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--intermediate", type=int, default=None, help="default: 4 * --hidden")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-lens", default="512", help="comma-separated prompt lengths, one table each")
    parser.add_argument(
        "--checkpoints", nargs=2, type=Path, metavar=("SOURCE", "CONVERTED"), help="load these instead of the sizes"
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rope-mode", choices=ROPE_MODES, default="drop")
    parser.add_argument("--forget-gate", action="store_true", help="PaTH-FoX (path_forget_gate=True)")
    parser.add_argument("--modes", nargs="+", choices=list(cache_modes()), default=list(cache_modes()))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help=THREADS_HELP)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "decode_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    models = load_models(*args.checkpoints) if args.checkpoints else build_models(args)
    vocab = next(iter(models.values())).config.vocab_size
    modes = cache_modes()
    runs = {f"{name}, {mode}": (model, modes[mode]) for name, model in models.items() for mode in args.modes}
    first = next(iter(models.values())).config
    print(f"# Greedy decode on CPU, torch {torch.__version__}, torch.set_num_threads({args.threads}), fp32;")
    print(
        f"# hidden {first.hidden_size}, intermediate {first.intermediate_size}, {first.num_hidden_layers} layers,"
        f" {first.num_attention_heads} heads ({first.num_key_value_heads} KV), vocab {vocab}, batch {args.batch};"
        f" {args.new_tokens} new tokens; median of {args.reps} after one warm-up."
    )
    results = []
    for prompt_len in (int(length) for length in args.prompt_lens.split(",")):
        prompt = torch.randint(1, vocab, (args.batch, prompt_len), generator=torch.Generator().manual_seed(0))
        loadavg_start = os.getloadavg()
        rows = measure(runs, prompt, args.new_tokens, args.reps)
        loadavg_end = os.getloadavg()
        base = rows[next(iter(rows))]
        print(f"\n## prompt {prompt_len} (load average {loadavg_start[0]:.2f} at start, {loadavg_end[0]:.2f} at end)")
        print("\n| model, cache | params | decode tok/s | vs the first row | generate(N) s | prefill + 1st token s |")
        print("|---|---|---|---|---|---|")
        for name, r in rows.items():
            ratio = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            print(
                f"| {name} | {r['params'] / 1e6:.2f}M | {r['decode_tokens_per_s']:.1f} | {ratio:.2f}x |"
                f" {r['generate_s']:.2f} | {r['prefill_plus_first_token_s']:.3f} |"
            )
        results.append({"prompt_len": prompt_len, "loadavg": [loadavg_start, loadavg_end], "rows": rows})
    machine = {"torch": torch.__version__, "threads": args.threads}
    result = {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "prompts": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"# JSON: {args.out}")


if __name__ == "__main__":
    main()
