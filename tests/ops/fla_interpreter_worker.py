"""Run FLA's Triton PaTH kernel on CPU tensors through the Triton interpreter.

    python tests/ops/fla_interpreter_worker.py CASES_IN.pt RESULTS_OUT.pt

TRITON_INTERPRET must be set before triton is first imported (triton.language's own helpers are decorated at
import time), and transformers imports triton, so this runs in its own process: the interpreter stays out of
the pytest session. Each case in CASES_IN.pt is a dict with q, k, v, w, beta, g (or None), cu_seqlens (or None)
and do; RESULTS_OUT.pt gets, per case, the outputs and gradients of `parallel_path_attn` ("fla"), and for cases
marked "api", those of `path_attention(backend="fla")` ("api", or the error it raised as a string).
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

prune_configs = Autotuner.prune_configs
# Benchmarking configs is meaningless in the interpreter and slow: take the first valid one.
Autotuner.prune_configs = lambda self, kwargs: prune_configs(self, kwargs)[:1]

from fla.ops.path_attn import parallel_path_attn  # noqa: E402

from path_hf.ops import path_attention  # noqa: E402

NAMES = ("q", "k", "v", "w", "beta", "g")


def run(fn, case: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    inputs = {name: None if case[name] is None else case[name].clone().requires_grad_() for name in NAMES}
    o, k_cache = fn(**inputs, cu_seqlens=case["cu_seqlens"])
    leaves = {name: x for name, x in inputs.items() if x is not None}
    grads = torch.autograd.grad(o, list(leaves.values()), case["do"])
    return {"o": o.detach(), "k_cache": k_cache, **{f"d{name}": grad for name, grad in zip(leaves, grads, strict=True)}}


def fla(**kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    return parallel_path_attn(**kwargs, use_cache=True)


def api(**kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    return path_attention(**kwargs, backend="fla", return_k_cache=True)


def main(cases_path: str, results_path: str) -> None:
    torch.set_num_threads(1)
    results = {}
    for name, case in torch.load(cases_path).items():
        results[name] = {"fla": run(fla, case)}
        if not case.get("api"):
            continue
        try:
            results[name]["api"] = run(api, case)
        except Exception as error:  # reported by the test that compares the API with FLA
            results[name]["api"] = f"{type(error).__name__}: {error}"
    torch.save(results, results_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
