"""Pretrain the embedded default model: a small RoPE Llama on the Python documentation, on one CPU thread.

Steps: train a byte-level BPE tokenizer on the train split (``data/train.jsonl.xz``, built by ``prepare_data.py``),
pack the documents as ``<s> text </s>`` into one token stream, train a ``LlamaForCausalLM`` from scratch on random
windows of ``--seq-len`` tokens (AdamW, linear warmup then cosine decay), evaluate the held-out split now and then,
and stop at ``--max-tokens`` or when ``--time-budget`` minutes have passed, whichever comes first. At the end it
measures held-out perplexity at 1x, 2x, 4x and 8x the training length and saves the model, tokenizer, log and a
summary into ``--out-dir``.

    OMP_NUM_THREADS=1 python examples/default_model/train_default_model.py --time-budget 50
"""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread: no rayon pool in tokenizers

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tokenizers import ByteLevelBPETokenizer, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from path_hf.evaluation import perplexity, read_texts, tokenize_stream

HERE = Path(__file__).resolve().parent
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on ``texts``; encoding adds ``<s>`` in front, as Llama's tokenizer does."""
    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS)
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )


def lr_at(step: int, max_steps: int, warmup: int, lr: float, min_lr: float) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``min_lr`` at ``max_steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def held_out_ppl(model: LlamaForCausalLM, stream: list[int], seq_len: int, max_windows: int | None = None) -> float:
    """Perplexity over the first ``max_windows`` (default: all) whole non-overlapping windows of ``seq_len`` tokens of
    ``stream``, each scored on its own (`path_hf.evaluation.perplexity`)."""
    windows = len(stream) // seq_len if max_windows is None else min(max_windows, len(stream) // seq_len)
    return perplexity(model, stream[: windows * seq_len], seq_len).ppl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=HERE / "data")
    parser.add_argument("--out-dir", type=Path, default=HERE / "checkpoint")
    parser.add_argument("--log-dir", type=Path, default=HERE, help="where train_log.jsonl and train_log.txt go")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--intermediate-size", type=int, default=704)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--min-lr", type=float, default=2e-4)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=6_000_000, help="token budget; sets the cosine schedule")
    parser.add_argument("--time-budget", type=float, default=None, help="minutes of training before stopping early")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-windows", type=int, default=64, help="held-out windows for the periodic eval")
    parser.add_argument("--final-lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.time()

    train_texts = read_texts([args.data_dir / "train.jsonl.xz"])
    eval_texts = read_texts([args.data_dir / "eval.jsonl.xz"])
    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    # One stream of `<s> document </s>`, in order.
    train_ids = torch.tensor(tokenize_stream(train_texts, tokenizer), dtype=torch.long)
    eval_ids = tokenize_stream(eval_texts, tokenizer)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    tokens_per_step = args.batch_size * args.seq_len
    max_steps = args.max_tokens // tokens_per_step
    args.log_dir.mkdir(parents=True, exist_ok=True)
    log_jsonl = open(args.log_dir / "train_log.jsonl", "w")
    log_txt = open(args.log_dir / "train_log.txt", "w")

    def log(record: dict, line: str) -> None:
        log_jsonl.write(json.dumps(record) + "\n")
        log_txt.write(line + "\n")
        log_jsonl.flush()
        log_txt.flush()
        print(line, flush=True)

    log(
        {"event": "start", "params": n_params, "train_tokens": len(train_ids), "eval_tokens": len(eval_ids)}
        | {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        f"params {n_params:,}, train split {len(train_ids):,} tokens, held-out {len(eval_ids):,} tokens, "
        f"{max_steps} steps of {tokens_per_step} tokens planned, setup {time.time() - start:.0f}s\n{vars(args)}",
    )

    generator = torch.Generator().manual_seed(args.seed)
    train_start = time.time()
    last_time, last_step = train_start, 0
    step, loss_value = 0, float("nan")
    stop_reason = "token budget"
    model.train()
    while step < max_steps:
        if args.time_budget is not None and time.time() - train_start > args.time_budget * 60:
            stop_reason = "time budget"
            break
        lr = lr_at(step, max_steps, args.warmup_steps, args.lr, args.min_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(train_ids) - args.seq_len, (args.batch_size,), generator=generator)
        batch = torch.stack([train_ids[o : o + args.seq_len] for o in offsets.tolist()])
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        step += 1
        loss_value = loss.item()

        if step % args.log_every == 0 or step == max_steps:
            now = time.time()
            tok_s = (step - last_step) * tokens_per_step / (now - last_time)
            last_time, last_step = now, step
            record = {"step": step, "tokens": step * tokens_per_step, "loss": loss_value, "lr": lr, "tok_s": tok_s}
            record["elapsed_s"] = now - train_start
            line = f"step {step:5d} | tokens {step * tokens_per_step:9,d} | loss {loss_value:.4f} | lr {lr:.2e} | "
            line += f"{tok_s:6.0f} tok/s | {(now - train_start) / 60:5.1f} min"
            if step % args.eval_every == 0:
                record["eval_ppl_256"] = held_out_ppl(model, eval_ids, args.seq_len, args.eval_windows)
                line += f" | held-out ppl@{args.seq_len} {record['eval_ppl_256']:.2f} ({args.eval_windows} windows)"
                last_time = time.time()
            log(record, line)

    train_time = time.time() - train_start
    tokens_seen = step * tokens_per_step
    log(
        {"event": "stop", "reason": stop_reason, "step": step, "tokens": tokens_seen, "train_time_s": train_time},
        f"stopped ({stop_reason}) at step {step}, {tokens_seen:,} tokens, {train_time / 60:.1f} min of training",
    )

    ppl = {}
    for length in args.final_lengths:
        ppl[length] = held_out_ppl(model, eval_ids, length)
        log(
            {"event": "final_eval", "seq_len": length, "ppl": ppl[length]},
            f"held-out ppl @ {length}: {ppl[length]:.2f}",
        )

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out_dir)
    tokenizer.save_pretrained(args.out_dir)
    summary = {
        "params": n_params,
        "train_seq_len": args.seq_len,
        "tokens_seen": tokens_seen,
        "steps": step,
        "stop_reason": stop_reason,
        "train_time_s": round(train_time, 1),
        "final_train_loss": loss_value,
        "train_split_tokens": len(train_ids),
        "epochs": round(tokens_seen / len(train_ids), 3),
        "eval_split_tokens": len(eval_ids),
        "eval_ppl": {str(length): round(p, 3) for length, p in ppl.items()},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    (args.out_dir / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log({"event": "saved", "out_dir": str(args.out_dir)}, f"saved to {args.out_dir}")


if __name__ == "__main__":
    main()
