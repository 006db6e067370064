# Copyright 2026 The path-hf authors. Apache-2.0.
"""`path-hf serve`: an OpenAI-compatible server for a PaTH model, transformers' own server (`transformers serve`)
loading it with path_hf's classes (`path_hf.serving`).

```
path-hf serve ./SmolLM2-135M-PaTH --host 127.0.0.1 --port 8000
```

Refused on one line before anything loads: `--continuous-batching` (PaTH layers cannot use its paged cache), a port
out of range, and a missing `serve` extra. docs/serving.md has the endpoints and the errors requests get.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..arguments import DTYPES


@dataclass(frozen=True)
class ServeOptions:
    """Every option of `path-hf serve`; the CLI flags are built from it (`path_hf.arguments`)."""

    model: str = field(
        metadata={
            "help": "the model to serve: a PaTH checkpoint directory or hub id (any causal LM that transformers "
            "serves loads too); requests name it exactly, or name no model",
            "positional": True,
            "metavar": "MODEL",
        }
    )
    host: str = field(default="127.0.0.1", metadata={"help": "the address to listen on (0.0.0.0: every interface)"})
    port: int = field(default=8000, metadata={"help": "the port to listen on"})
    device: str = field(default="auto", metadata={"help": "where the model runs: auto, cpu, cuda, cuda:1, mps, ..."})
    dtype: str = field(
        default="auto",
        metadata={"help": "the dtype the model runs in; auto: the checkpoint's", "choices": ("auto", *DTYPES)},
    )
    max_model_len: int | None = field(
        default=None,
        metadata={
            "help": "the longest a request may be, prompt and answer, in tokens (default and most: the model's "
            "max_position_embeddings); a longer prompt is refused",
            "metavar": "TOKENS",
        },
    )
    continuous_batching: bool = field(
        default=False,
        metadata={"help": "refused: PaTH layers cannot use continuous batching's paged KV cache"},
    )
    log_level: str = field(
        default="info",
        metadata={"help": "the level of the server's log", "choices": ("debug", "info", "warning", "error")},
    )


def run_serve(options: ServeOptions) -> None:
    """Serve `options.model` until interrupted (Ctrl-C, SIGTERM)."""
    from ..serving import serve

    serve(
        options.model,
        options.host,
        options.port,
        device=options.device,
        dtype=options.dtype,
        max_model_len=options.max_model_len,
        continuous_batching=options.continuous_batching,
        log_level=options.log_level,
    )


__all__ = ["ServeOptions", "run_serve"]
