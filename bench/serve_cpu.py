"""CPU benchmark: tokens/s served by `path-hf serve` on a converted model against `transformers serve` on its source.

    python bench/serve_cpu.py --source examples/default_model/checkpoint --converted runs/bench/default-path

Each server runs as its own process on a free port of 127.0.0.1 (`OMP_NUM_THREADS` = --threads), one after the other,
and gets the same requests from the `openai` client: --requests greedy completions (temperature 0, --new-tokens each:
`min_new_tokens` in the request's `generation_config` holds the EOS back), streamed, one at a time after one warm-up.
Served tokens/s = new tokens / wall seconds of a request, from the client's side (HTTP, tokenizer and the server's
own work included); the median over the requests. Prints a Markdown table; writes JSON to bench/out/.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import openai

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(command: list[str], threads: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_until_serving(client: openai.OpenAI, process: subprocess.Popen, seconds: float) -> str:
    """The served model's id, once `/v1/models` answers."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"error: the server exited with {process.returncode} before serving (see its log)")
        try:
            return client.models.list().data[0].id
        except (openai.APIConnectionError, IndexError):
            time.sleep(0.5)
    raise SystemExit(f"error: no server answered within {seconds:.0f} s")


def request_seconds(client: openai.OpenAI, model: str, new_tokens: int) -> tuple[float, int]:
    """One streamed greedy completion: its wall seconds and the number of chunks that carried text."""
    start_time = time.perf_counter()
    stream = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=new_tokens,
        temperature=0,
        stream=True,
        # transformers serve's own field: generation settings as JSON; min_new_tokens holds the EOS back
        extra_body={"generation_config": json.dumps({"min_new_tokens": new_tokens})},
    )
    chunks = sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text)
    return time.perf_counter() - start_time, chunks


def measure(name: str, command: list[str], args: argparse.Namespace) -> dict:
    port = free_port()
    log = args.out.parent / f"serve_cpu-{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    process = start([*command, "--host", "127.0.0.1", "--port", str(port)], args.threads, log)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
        model = wait_until_serving(client, process, args.startup_seconds)
        request_seconds(client, model, args.new_tokens)  # warm-up: loads the model in the server's model process
        runs = [request_seconds(client, model, args.new_tokens) for _ in range(args.requests)]
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    seconds = [run[0] for run in runs]
    return {
        "command": command,
        "model": model,
        "seconds": seconds,
        "text_chunks": [run[1] for run in runs],
        "tokens_per_s": args.new_tokens / statistics.median(seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, required=True, help="a RoPE checkpoint (`transformers serve`)")
    parser.add_argument("--converted", type=Path, required=True, help="its conversion (`path-hf serve`)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--startup-seconds", type=float, default=300)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "serve_cpu.json")
    args = parser.parse_args()
    bin_dir = Path(sys.executable).parent
    servers = {
        f"transformers serve, source ({args.source.name})": (
            "source",
            [str(bin_dir / "transformers"), "serve", str(args.source), "--device", "cpu", "--dtype", "float32"],
        ),
        f"path-hf serve, converted ({args.converted.name})": (
            "converted",
            [str(bin_dir / "path-hf"), "serve", str(args.converted), "--device", "cpu", "--dtype", "float32"],
        ),
    }
    load = os.getloadavg()
    rows = {label: measure(name, command, args) for label, (name, command) in servers.items()}
    print(
        f"# {args.requests} streamed greedy completions of {args.new_tokens} tokens each, one at a time, "
        f"OMP_NUM_THREADS={args.threads}; load average at start {load[0]:.2f}, at end {os.getloadavg()[0]:.2f}"
    )
    print("\n| server | served tok/s | vs the first row |\n|---|---:|---:|")
    base = next(iter(rows.values()))["tokens_per_s"]
    for label, row in rows.items():
        print(f"| {label} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / base:.2f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    print(f"# JSON: {args.out}")


if __name__ == "__main__":
    main()
