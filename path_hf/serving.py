# Copyright 2026 The path-hf authors. Apache-2.0.
"""An OpenAI-compatible server for PaTH models: transformers' own (`transformers serve`: its FastAPI app, handlers,
model manager and model process), with one change, how the model loads (`PaTHModelLoader`).

transformers' `ModelLoader._load_model` finds a checkpoint's class as an attribute of the `transformers` module
(`getattr(transformers, config.architectures[0])`), which a model registered with the Auto classes is not:
`transformers serve --trust-remote-code ./a-path-model` fails with `AttributeError: module transformers has no
attribute PaTHLlamaForCausalLM` (and remote code, were it found, would be the code copied beside the weights, not
path_hf's).
`PaTHModelLoader` loads a `path_llama` checkpoint through `AutoModelForCausalLM`, where `import path_hf` registered
`PaTHLlamaForCausalLM`, with the same arguments; any other checkpoint loads as upstream does. The model's process
(spawned) unpickles the loader, which imports this module and so path_hf: the classes are registered there too, and
no remote code runs. Upstream, looking the architecture up through the Auto classes (`AutoModelForCausalLM`'s mapping,
which holds registered classes) instead of `getattr(transformers, ...)` would make this class unnecessary
(docs/serving.md).

Generation is transformers' `GenerateRunner`: `model.generate()`, one request at a time, so the cache is the one
`generate` builds from the model's config (`DynamicCache(config=...)`): PaTH layers get `PaTHCacheLayer`, a hybrid's
local layers their bounded `LocalCacheLayer` (the last `local_window` keys and the sinks), and memory stays flat over a
long chat. Continuous batching is refused (`serve`): its paged cache has no place for a PaTH layer's transformed keys
and gate, nor for the local layers' window.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.cli.serve import Serve
from transformers.cli.serving.model_manager import ModelLoader
from transformers.cli.serving.utils import parse_model_id
from transformers.utils.import_utils import is_serve_available

from .configuration_path_llama import PaTHLlamaConfig
from .errors import CommandError


class ServeError(CommandError):
    """`path-hf serve` was refused: an option the model cannot honour, a missing dependency."""


class PaTHModelLoader(ModelLoader):
    """transformers' `ModelLoader`, loading a `path_llama` checkpoint through `AutoModelForCausalLM` (where
    `import path_hf` registered `PaTHLlamaForCausalLM`) rather than as an attribute of the `transformers` module."""

    def _load_model(
        self, model_id: str, tqdm_class: type | None = None, progress_callback: Callable | None = None
    ) -> PreTrainedModel:
        repo, revision, gguf_file = parse_model_id(model_id)
        config = AutoConfig.from_pretrained(repo, revision=revision, gguf_file=gguf_file, trust_remote_code=False)
        if config.model_type != PaTHLlamaConfig.model_type:
            return super()._load_model(model_id, tqdm_class=tqdm_class, progress_callback=progress_callback)
        if progress_callback is not None:
            progress_callback({"status": "loading", "model": model_id, "stage": "config"})
        kwargs = {
            "revision": revision,
            "attn_implementation": self.attn_implementation,
            "dtype": self.dtype,
            "device_map": self.device,
            # path_hf's classes, registered with the Auto classes: never the code saved beside the weights
            "trust_remote_code": False,
            "tqdm_class": tqdm_class,
        }
        quantization_config = self.get_quantization_config()
        if quantization_config is not None:
            kwargs["quantization_config"] = quantization_config
        return AutoModelForCausalLM.from_pretrained(repo, **kwargs)


class PaTHServe(Serve):
    """`transformers serve` with its model loaded by `loader` (a `PaTHModelLoader`). `Serve.__init__` builds
    transformers' own `ModelLoader` and then runs the server (`run`), whose model manager loads through
    `self.loader`: `run` puts `loader` there first."""

    def __init__(self, loader: ModelLoader, **kwargs) -> None:
        self.path_loader = loader
        super().__init__(**kwargs)

    def run(self, socket=None, engine_connection=None) -> None:
        self.loader = self.path_loader
        super().run(socket, engine_connection)


def check_options(continuous_batching: bool = False, port: int = 8000, max_model_len: int | None = None) -> None:
    """Refuse, on one line, what the server cannot honour, before anything loads."""
    if continuous_batching:
        raise ServeError(
            "--continuous-batching is refused: its paged KV cache has no place for a PaTH layer's transformed keys "
            "and forget gate, nor for a hybrid's local window, so it would serve wrong tokens; path-hf serve "
            "generates one request at a time with model.generate() and the model's own cache."
        )
    if not 0 <= port < 65536:
        raise ServeError(f"--port must be between 0 and 65535, got {port}.")
    if max_model_len is not None and max_model_len < 2:
        raise ServeError(f"--max-model-len must be at least 2 tokens, got {max_model_len}.")
    if not is_serve_available():
        raise ServeError(
            "serving needs fastapi, uvicorn, pydantic and openai: pip install 'path-hf[serve]' (transformers' "
            "`serving` extra)."
        )


def serve(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    device: str = "auto",
    dtype: str = "auto",
    max_model_len: int | None = None,
    continuous_batching: bool = False,
    log_level: str = "info",
) -> None:
    """Serve `model` on `host:port` until interrupted: `/v1/models`, `/v1/chat/completions` and `/v1/completions`
    (streaming or not) and the rest of `transformers serve`'s API, the model loaded by `PaTHModelLoader` in a process
    of its own. Refuses (`ServeError`) what `check_options` refuses."""
    check_options(continuous_batching=continuous_batching, port=port, max_model_len=max_model_len)
    PaTHServe(
        PaTHModelLoader(device=device, dtype=dtype),
        force_model=model,
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        host=host,
        port=port,
        log_level=log_level,
    )


__all__ = ["PaTHModelLoader", "PaTHServe", "ServeError", "check_options", "serve"]
