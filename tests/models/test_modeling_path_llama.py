import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModel, AutoModelForCausalLM, DataCollatorWithFlattening
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb

from path_hf import (
    PaTHLlamaAttention,
    PaTHLlamaConfig,
    PaTHLlamaForCausalLM,
    PaTHLlamaModel,
    PaTHLlamaRoPEAttention,
    init_path_parameters,
)
from path_hf.modeling_path_llama import PATH_MODULES, PaTHGain
from path_hf.ops import naive_path_attention
from tests.models.tiny_models import SOURCES, path_config_from, random_tokens, tiny_model, tiny_model_config
from tests.ops.ranges import counted_ranges


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("rope_mode", ["keep", "interleave"])
@pytest.mark.parametrize("forget_gate", [False, True], ids=["path", "path-fox"])
@pytest.mark.parametrize("source", list(SOURCES))
def test_identity_init_keeps_the_source_logits(source, forget_gate, rope_mode, tmp_path):
    """A source checkpoint loads with no renaming; with RoPE kept or interleaved and beta = 0 the logits are the
    source's."""
    model_class, source_config, path_fields = SOURCES[source]
    torch.manual_seed(0)
    source_model = model_class(source_config).eval()
    source_model.save_pretrained(tmp_path)
    config = path_config_from(
        source_config, rope_mode=rope_mode, path_init="identity", path_forget_gate=forget_gate, **path_fields
    )
    model, info = PaTHLlamaForCausalLM.from_pretrained(tmp_path, config=config, output_loading_info=True)
    assert info["unexpected_keys"] == set() and not info["mismatched_keys"]
    assert all(any(f".{name}." in key for name in PATH_MODULES) for key in info["missing_keys"])

    ids = random_tokens(2, 11)
    expected = source_model(ids).logits
    assert (model(ids).logits - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_from_pretrained_initialises_the_new_parameters(tmp_path):
    model_class, source_config, _ = SOURCES["llama-gqa-bias-headdim"]
    torch.manual_seed(0)
    source = model_class(source_config)
    source.save_pretrained(tmp_path)
    for path_init, gain, gate_bias in [("identity", 0.0, 0.0), ("default", 1.0, 0.0), ("default", 1.0, 6.0)]:
        config = path_config_from(
            source_config, path_init=path_init, path_forget_gate=True, path_w_rank=8, path_forget_gate_bias=gate_bias
        )
        model = PaTHLlamaForCausalLM.from_pretrained(tmp_path, config=config)
        for layer in model.model.layers:
            attn = layer.self_attn
            assert torch.all(attn.bt_gain.weight == gain) and torch.all(attn.g_gain.weight == gain)
            assert torch.all(attn.bt_proj.bias == 0) and torch.all(attn.g_proj.bias == gate_bias)
            for weight in (attn.w_proj[0].weight, attn.w_proj[1].weight, attn.w_conv1d.weight, attn.bt_proj.weight):
                assert weight.isfinite().all() and 0.5 * 0.02 < weight.std() < 2 * 0.02
        state = model.state_dict()
        for name, tensor in source.state_dict().items():
            torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize("path_init", ["default", "identity"])
def test_init_path_parameters_on_a_fresh_layer(path_init):
    """What the checkpoint converter does: build one attention layer and initialise its PaTH parameters."""
    config = tiny_model_config(path_init=path_init, path_w_rank=4, initializer_range=0.02)
    attn = PaTHLlamaAttention(config, layer_idx=0)
    path_params = {n: p for n, p in attn.named_parameters() if n.startswith(("w_", "bt_", "g_"))}
    source_params = {n: p.clone() for n, p in attn.named_parameters() if n not in path_params}
    with torch.no_grad():
        for param in path_params.values():
            param.fill_(float("nan"))
    init_path_parameters(attn, config)
    gain = 0.0 if path_init == "identity" else 1.0
    assert torch.all(attn.bt_gain.weight == gain) and torch.all(attn.g_gain.weight == gain)
    assert torch.all(attn.bt_proj.bias == 0) and torch.all(attn.g_proj.bias == 0)
    for name, param in path_params.items():
        if name.endswith("weight") and "_gain." not in name:
            assert 0.5 * 0.02 < param.std() < 2 * 0.02, name
    for name, param in attn.named_parameters():
        if name in source_params:
            torch.testing.assert_close(param, source_params[name], rtol=0, atol=0)


def test_identity_init_learns_from_the_first_step():
    torch.manual_seed(0)
    config = tiny_model_config(rope_mode="keep", path_init="identity", initializer_range=0.02)
    model = PaTHLlamaForCausalLM(config)
    ids = random_tokens(2, 16)
    before = model(ids).logits.detach()
    model(ids, labels=ids).loss.backward()
    gains = [p for n, p in model.named_parameters() if n.endswith("_gain.weight")]
    assert len(gains) == 2 * config.num_hidden_layers
    assert all(p.grad.abs().min() > 0 for p in gains)

    torch.optim.SGD(model.parameters(), lr=1.0).step()
    assert all((p != 0).all() for p in gains)
    assert not torch.allclose(model(ids).logits, before, rtol=0, atol=1e-4)


def test_gain_folds_its_weight_into_0_1():
    gain = PaTHGain(7)
    x = torch.rand(5, 7)
    with torch.no_grad():
        gain.weight.copy_(torch.tensor([0.0, 0.25, 1.0, -0.3, 1.5, 2.6, -1.2]))
    out = gain(x)
    torch.testing.assert_close(out, x * torch.tensor([0.0, 0.25, 1.0, 0.3, 0.5, 0.6, 0.8]))
    out.sum().backward()
    torch.testing.assert_close(gain.weight.grad, x.sum(0) * torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 1.0, 1.0]))


def test_training_from_the_identity_keeps_every_gain_acting():
    """Trained from the identity, beta moves off 0 in every head, and every gain still acts on the output: moving
    its weight either way changes the logits (a gain clamped to [0, 1] would sit dead outside it)."""
    torch.manual_seed(0)
    model = PaTHLlamaForCausalLM(tiny_model_config(rope_mode="keep", path_init="identity", initializer_range=0.02))
    ids = random_tokens(2, 16)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(6):
        optimizer.zero_grad()
        model(ids, labels=ids).loss.backward()
        optimizer.step()

    betas = []
    hooks = [
        layer.self_attn.bt_gain.register_forward_hook(lambda module, args, beta: betas.append(beta))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        logits = model(ids).logits
    for hook in hooks:
        hook.remove()
    assert all((beta.abs().amin(dim=(0, 1)) > 0).all() for beta in betas)

    gains = [module.weight for module in model.modules() if isinstance(module, PaTHGain)]
    assert len(gains) == 2 * model.config.num_hidden_layers
    with torch.no_grad():
        for weight in gains:
            for head in range(weight.numel()):
                for step in (-0.01, 0.01):
                    weight[head] += step
                    moved = (model(ids).logits - logits).abs().max()
                    weight[head] -= step
                    assert moved > 1e-6, (weight, head, step)


def test_all_linear_lora_merges_into_the_same_model():
    """A user's own LoRA on every Linear, PaTH's bt_proj and g_proj included, gives the same logits merged."""
    model = tiny_model()
    ids = random_tokens(2, 10)
    with torch.no_grad():
        base = model(ids).logits
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    wrapped = {name.rsplit(".", 1)[-1] for name, module in peft_model.named_modules() if hasattr(module, "lora_A")}
    assert {"w_proj", "bt_proj", "g_proj", "q_proj"} <= wrapped
    with torch.no_grad():
        expected = peft_model(ids).logits
        assert max_rel_err(expected, base) > 1e-2  # the adapters act
        merged = peft_model.merge_and_unload()
        assert not any("lora" in name for name, _ in merged.named_parameters())
        assert max_rel_err(merged(ids).logits, expected) < 1e-5


def reference_path_layer(attn: PaTHLlamaAttention, x: torch.Tensor, cos_sin, w_cos_sin=None) -> torch.Tensor:
    """A PaTH layer written out from its parameters, with naive_path_attention (token by token); `w_cos_sin`: the
    RoPE that turns w with rope_mode="interleave" (default: `cos_sin`)."""
    config = attn.config
    B, T, _ = x.shape
    H, D = config.num_key_value_heads, config.head_dim
    q = attn.q_norm(attn.q_proj(x).view(B, T, -1, D))
    k = attn.k_norm(attn.k_proj(x).view(B, T, H, D))
    v = attn.v_proj(x).view(B, T, H, D)
    w = attn.w_proj(x)
    if config.path_conv_size:
        K = config.path_conv_size
        w = F.silu(F.conv1d(w.transpose(1, 2), attn.w_conv1d.weight, padding=K - 1, groups=w.shape[-1])[..., :T])
        w = w.transpose(1, 2)
    w = w.view(B, T, H, D)
    w = w / torch.sqrt((w * w).sum(-1, keepdim=True) + 1e-6)  # FLA's l2_norm
    if config.rope_mode == "keep":
        q, k = apply_rotary_pos_emb(q, k, *cos_sin, unsqueeze_dim=2)
    elif config.rope_mode == "interleave":
        q, k = apply_rotary_pos_emb(q, k, *cos_sin, unsqueeze_dim=2)
        w = apply_rotary_pos_emb(w, w, *(w_cos_sin or cos_sin), unsqueeze_dim=2)[0]
    beta = config.path_beta_max * torch.sigmoid(F.linear(x, attn.bt_proj.weight, attn.bt_proj.bias))
    g = None
    if config.path_forget_gate:
        g = F.logsigmoid(F.linear(x, attn.g_proj.weight, attn.g_proj.bias))
    o = naive_path_attention(q, k, v, w, beta, g)
    return attn.o_proj(o.reshape(B, T, -1))


@pytest.mark.parametrize(
    "fields",
    [
        dict(rope_mode="drop", path_conv_size=0, path_forget_gate=False),
        dict(rope_mode="keep", path_conv_size=3, path_forget_gate=True),
        dict(rope_mode="keep", path_conv_size=4, path_forget_gate=False, path_w_rank=4, qk_norm=True, head_dim=16),
        dict(rope_mode="interleave", path_conv_size=3, path_forget_gate=True),
    ],
    ids=["drop-noconv", "keep-conv3-fox", "keep-conv4-lowrank-qknorm", "interleave-conv3-fox"],
)
def test_path_layer_matches_reference(fields):
    model = tiny_model(**fields)
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 13, model.config.hidden_size)
    position_ids = torch.arange(13)[None]
    cos_sin = model.model.rotary_emb(x, position_ids)
    out, _ = attn(x, position_embeddings=cos_sin, position_ids=position_ids)
    expected = reference_path_layer(attn, x, cos_sin)
    assert max_rel_err(out, expected) < 1e-5


def test_long_inference_over_superblocks_keeps_the_logits():
    """Past 1024 tokens a CPU forward without gradients runs the torch backend over superblocks
    (`ops_superblock.superblock_attention`): the logits and the next step's cache are those of the walk alone
    (float32 sums in another order; the layers' `chunk_options` turn them off), for a 2-row batch, every PaTH feature
    on."""
    model = tiny_model(rope_mode="keep")
    tokens = random_tokens(2, 1100)

    def run() -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
        with torch.no_grad(), counted_ranges() as ran:
            prefill = model(tokens[:, :-1], use_cache=True)
            step = model(tokens[:, -1:], cache=prefill.past_key_values, use_cache=True)
        return (prefill.logits, step.logits), ran["path_attention.superblocks"]

    with_superblocks, superblocks = run()
    assert superblocks  # the superblocks did run
    for layer in model.model.layers:
        layer.self_attn.chunk_options = {"superblock_tokens": 0}
    walk_only, superblocks = run()
    assert not superblocks
    for got, expected in zip(with_superblocks, walk_only, strict=True):
        assert max_rel_err(got, expected) < 1e-5


def test_interleave_scores_are_householders_between_unit_rotations():
    """rope_mode="interleave": the logit of (i, j) is q_i^T H_i R^-1 H_{i-1} R^-1 ... H_{j+1} R^-1 k_j with q, k, w
    as projected (no RoPE) and R the rotation RoPE applies for one position, formed here as a D x D matrix: RoPE's
    turn by one position between consecutive Householder transforms. The layer's output against attention over those
    logits, written out with explicit matrices."""
    model = tiny_model(rope_mode="interleave", path_forget_gate=False, path_conv_size=0).double()
    config, attn = model.config, model.model.layers[0].self_attn
    B, T, D, H = 1, 9, config.head_dim, config.num_key_value_heads
    x = torch.randn(B, T, config.hidden_size, dtype=torch.float64)
    position_ids = torch.arange(T)[None]
    cos_sin = model.model.rotary_emb(x, position_ids)
    out, _ = attn(x, position_embeddings=cos_sin, position_ids=position_ids)

    q = attn.q_proj(x).view(B, T, -1, D)[0]
    k, v = (proj(x).view(B, T, H, D)[0] for proj in (attn.k_proj, attn.v_proj))
    w = attn.w_proj(x).view(B, T, H, D)[0]
    w = w / torch.sqrt((w * w).sum(-1, keepdim=True) + 1e-6)  # FLA's l2_norm
    beta = config.path_beta_max * torch.sigmoid(attn.bt_proj(x))[0]
    # R: RoPE at position 1 applied to the basis vectors (transformers' own apply_rotary_pos_emb)
    cos1, sin1 = (t[0, 1] for t in cos_sin)
    eye = torch.eye(D, dtype=torch.float64)
    rotation = apply_rotary_pos_emb(eye, eye, cos1, sin1, unsqueeze_dim=0)[0].T  # R e_d = column d
    inverse = torch.linalg.inv(rotation)
    group = q.shape[1] // H
    heads = []
    for head in range(q.shape[1]):
        kv = head // group
        householder = [eye - beta[t, kv] * torch.outer(w[t, kv], w[t, kv]) for t in range(T)]
        logits = torch.full((T, T), float("-inf"), dtype=torch.float64)
        for i in range(T):
            transport = eye  # H_i R^-1 ... H_{j+1} R^-1
            for j in range(i, -1, -1):
                logits[i, j] = q[i, head] @ transport @ k[j, kv] * attn.scaling
                transport = transport @ householder[j] @ inverse
        heads.append(torch.softmax(logits, -1) @ v[:, kv])
    expected = attn.o_proj(torch.stack(heads, 1).reshape(1, T, -1))
    assert max_rel_err(out, expected) < 1e-6  # RoPE's angles are float32: R_t is R^t to about 1e-7


@pytest.mark.parametrize("rope_mode", ["keep", "interleave"])
def test_interleave_is_shift_invariant(rope_mode):
    """Moving every token by the same number of positions leaves the logits of rope_mode="interleave" unchanged, as
    for RoPE alone; with "keep" the Householder directions stay fixed while q and k turn, so they change."""
    model = tiny_model(rope_mode=rope_mode).double()
    ids = random_tokens(2, 20)
    at_start = model(ids, position_ids=torch.arange(20)[None]).logits
    moved = model(ids, position_ids=torch.arange(20)[None] + 37).logits
    difference = max_rel_err(moved, at_start)
    if rope_mode == "interleave":
        assert difference < 1e-6  # RoPE's angles are computed in float32
    else:
        assert difference > 1e-3


def test_mixed_path_layers():
    model = tiny_model(path_layers=[1], rope_mode="drop")
    plain, path = (layer.self_attn for layer in model.model.layers)
    assert type(plain) is PaTHLlamaRoPEAttention and isinstance(path, PaTHLlamaAttention)
    assert not any(name.startswith(("w_", "bt_", "g_")) for name, _ in plain.named_parameters())
    # The RoPE layer is Llama's attention: same output as LlamaAttention holding its weights.
    llama = LlamaAttention(model.config, layer_idx=0)
    llama.load_state_dict(plain.state_dict())
    x = torch.randn(2, 9, model.config.hidden_size)
    cos_sin = model.model.rotary_emb(x, torch.arange(9)[None])
    torch.testing.assert_close(plain(x, cos_sin, None)[0], llama(x, cos_sin, None)[0])


PACKING_CASES = {
    "all-path": {},
    "mixed": {"path_layers": [0]},
    "nofox-noconv": {"path_forget_gate": False, "path_conv_size": 0},
}


@pytest.mark.parametrize("fields", list(PACKING_CASES.values()), ids=list(PACKING_CASES))
def test_packed_batch_equals_separate_sequences(fields):
    model = tiny_model(**fields).train()
    sequences = [random_tokens(1, n, seed=n)[0] for n in (5, 9, 4)]
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": s.tolist()} for s in sequences])
    packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"])
    packed.loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    separate_logits, total_loss = [], 0.0
    n_targets = sum(len(s) - 1 for s in sequences)
    for s in sequences:
        out = model(s[None], labels=s[None])
        separate_logits.append(out.logits[0])
        total_loss = total_loss + out.loss * (len(s) - 1) / n_targets
    total_loss.backward()

    expected = torch.cat(separate_logits)
    assert max_rel_err(packed.logits[0], expected) < 1e-5
    torch.testing.assert_close(packed.loss, total_loss)
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_unpadded(side):
    model = tiny_model(rope_mode="keep", path_layers=[0])
    lengths = (6, 10, 3)
    sequences = [random_tokens(1, n, seed=n)[0] for n in lengths]
    T = max(lengths)
    ids = random_tokens(len(lengths), T, seed=1)  # real tokens under the padding: it must be ignored
    mask = torch.zeros_like(ids)
    for row, s in enumerate(sequences):
        cols = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[row, cols], mask[row, cols] = s, 1
    logits = model(ids, attention_mask=mask).logits
    for row, s in enumerate(sequences):
        assert max_rel_err(logits[row][mask[row].bool()], model(s[None]).logits[0]) < 1e-5


def test_collator_sequence_boundaries_equal_found_ones():
    """`cu_seq_lens_q` from the collator (transformers' flash-attention kwargs) are used as they come."""
    model = tiny_model(rope_mode="keep", path_layers=[1])
    sequences = [random_tokens(1, n, seed=n)[0].tolist() for n in (5, 9, 4)]
    batch = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True)(
        [{"input_ids": s} for s in sequences]
    )
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 14, 18]
    given = model(**{name: value for name, value in batch.items() if name != "labels"}).logits
    found = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    torch.testing.assert_close(given, found, rtol=0, atol=0)


class HostSyncCounter(TorchDispatchMode):
    """Counts the ops that make the host wait for the device on GPU (on CPU they cost nothing, but are the same ops):
    reading a value (`.item()`, `bool()`, `int()`), `nonzero`, boolean indexing, `repeat_interleave` without
    `output_size`. (`.tolist()` does not dispatch on CPU and goes uncounted.)"""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func in (aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default):
            self.count += 1
        elif func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.count += 1
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.count += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("inputs", ["plain", "packed", "padded"])
@pytest.mark.parametrize("mixed", [False, True], ids=["all-path", "mixed"])
def test_host_syncs_per_forward_do_not_grow_with_layers(inputs, mixed, monkeypatch):
    """Packing and padding are found once per forward, and passed down (`cu_seq_lens_q`, `indices_q`); the layers,
    `path_attention`'s checks and its torch backend read nothing more from the device."""
    from path_hf import modeling_path_llama

    sequences = [random_tokens(1, n, seed=n)[0].tolist() for n in (70, 9, 50)]  # chunks of 64: a walk to run
    if inputs == "padded":
        T = max(map(len, sequences))
        ids, mask = torch.zeros(3, T, dtype=torch.long), torch.zeros(3, T, dtype=torch.long)
        for row, s in enumerate(sequences):
            ids[row, T - len(s) :], mask[row, T - len(s) :] = torch.tensor(s), 1
        batch = {"input_ids": ids, "attention_mask": mask}
    elif inputs == "packed":
        batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": s} for s in sequences])
        batch = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    else:
        batch = {"input_ids": torch.tensor([sequences[0]])}

    calls = []
    for name in ("packed_sequences", "unpadded_sequences"):
        found = getattr(modeling_path_llama, name)
        monkeypatch.setattr(modeling_path_llama, name, lambda *args, found=found: calls.append(1) or found(*args))

    syncs = {}
    for layers in (2, 4):
        model = tiny_model(num_hidden_layers=layers, path_layers=list(range(0, layers, 2)) if mixed else None).train()
        calls.clear()
        with HostSyncCounter() as counter:
            model(**batch)
        syncs[layers] = counter.count
        assert len(calls) == (inputs != "plain")
    assert syncs[2] == syncs[4]


def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny_model(path_layers=[1]).train()
    ids, mask = random_tokens(2, 12), torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0

    def grads():
        model.zero_grad()
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    model.activation_checkpointing_enable()
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    checkpointed = grads()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad)


def test_gradient_checkpointing_keeps_the_walks_keys():
    """A checkpointed layer is recomputed in backward, so the torch backend keeps the running keys of that second walk
    rather than recompute them once more: two walks per layer and step and no keys recomputed in backward, against
    one walk whose backward recomputes its keys without checkpointing (where every walk is made to recompute them)."""
    model = tiny_model().train()
    for layer in model.model.layers:  # by default, every walk's keys are recomputed
        layer.self_attn.chunk_options = {"checkpoint_above_bytes": 0}
    # 4 chunks of 64 (too few to merge, `default_walk_merges`): steps 1-3 of the walk, one segment; 2 key steps a walk
    ids = random_tokens(1, 200)

    def walks_and_grads():
        model.zero_grad()
        with counted_ranges() as ran:
            model(ids, labels=ids).loss.backward()
        counts = {"walks": ran["path_attention.walk"], "key steps": ran["path_attention.next_keys"]}
        return counts, {n: p.grad.clone() for n, p in model.named_parameters()}

    layers = model.config.num_hidden_layers
    plain_counts, plain = walks_and_grads()
    assert plain_counts == {"walks": layers, "key steps": 2 * 2 * layers}  # forward, and backward's recomputation
    model.activation_checkpointing_enable()
    checkpointed_counts, checkpointed = walks_and_grads()
    assert checkpointed_counts == {"walks": 2 * layers, "key steps": 2 * 2 * layers}  # forward and recomputed forward
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=0, atol=0)

    model.activation_checkpointing_enable(every_n_layers=2)
    assert [layer.self_attn.gradient_checkpointing for layer in model.model.layers] == [True, False]
    model.activation_checkpointing_disable()
    assert not any(layer.self_attn.gradient_checkpointing for layer in model.model.layers)


def test_bf16_forward_and_generate():
    model = tiny_model(rope_mode="keep")
    ids, mask = random_tokens(2, 12), torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    expected = model(ids, attention_mask=mask).logits
    model.to(torch.bfloat16)
    logits = model(ids, attention_mask=mask).logits
    assert logits.dtype == torch.bfloat16 and logits.isfinite().all()
    assert max_rel_err(logits.float()[mask.bool()], expected[mask.bool()]) < 5e-2
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 16)


def test_auto_classes():
    config = tiny_model_config()
    assert type(AutoModel.from_config(config)) is PaTHLlamaModel
    assert type(AutoModelForCausalLM.from_config(config)) is PaTHLlamaForCausalLM


TENSOR_PARALLEL_CHILD = """
import sys

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, DistributedConfig

import path_hf

model_dir = sys.argv[1]
ids = torch.randint(1, 101, (2, 9), generator=torch.Generator().manual_seed(0))
reference = AutoModelForCausalLM.from_pretrained(model_dir)
sharded = AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(tp_size=2))
assert isinstance(sharded.model.layers[1].mlp.up_proj.weight, DTensor)
assert not any(isinstance(p, DTensor) for p in sharded.model.layers[1].self_attn.parameters())
outputs = [model(ids, labels=ids) for model in (reference, sharded)]
for out in outputs:
    out.loss.backward()
torch.testing.assert_close(outputs[1].logits, outputs[0].logits)
for (name, param), sharded_param in zip(reference.named_parameters(), sharded.parameters(), strict=True):
    grad = sharded_param.grad.full_tensor() if isinstance(sharded_param.grad, DTensor) else sharded_param.grad
    torch.testing.assert_close(grad, param.grad, msg=name)
with torch.no_grad():
    expected = reference.generate(ids, max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(sharded.generate(ids, max_new_tokens=4, do_sample=False), expected, rtol=0, atol=0)
"""


def test_tensor_parallel_plan(tmp_path):
    """`from_pretrained(distributed_config=DistributedConfig(tp_size=2))` on two CPU processes (gloo) shards the MLPs
    and keeps each attention layer whole: logits, gradients and greedy generation equal the unsharded model's."""
    assert not any("self_attn" in name for name in PaTHLlamaConfig.base_model_tp_plan)
    tiny_model(path_layers=[1]).save_pretrained(tmp_path / "model")
    (tmp_path / "child.py").write_text(TENSOR_PARALLEL_CHILD)
    child = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        + [str(tmp_path / "child.py"), str(tmp_path / "model")],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]


def test_save_load_round_trip(tmp_path):
    model = tiny_model(path_layers=[0], path_w_rank=4, qk_norm=True)
    model.save_pretrained(tmp_path)
    loaded = PaTHLlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.to_dict() == {**model.config.to_dict(), "_name_or_path": str(tmp_path)}
    ids = random_tokens(2, 10)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


REMOTE_CODE_CHILD = """
import sys

# An environment without path_hf (and without FLA): the saved code must be self-contained.
sys.modules["path_hf"] = sys.modules["fla"] = None
import torch
from transformers import AutoModelForCausalLM

model_dir, io_file = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
inputs = torch.load(io_file)
out = model.generate(**inputs, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
torch.save({"logits": model(**inputs).logits, "sequences": out.sequences, "step_logits": out.logits}, io_file)
"""


def test_trust_remote_code_load_without_path_hf(tmp_path):
    model = tiny_model(path_layers=[1], path_w_rank=4, qk_norm=True)
    model.save_pretrained(tmp_path / "model")
    assert {"modeling_path_llama.py", "configuration_path_llama.py", "cache_path_llama.py", "ops.py"} <= {
        p.name for p in (tmp_path / "model").iterdir()
    }
    inputs = {"input_ids": random_tokens(2, 7), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    inputs["attention_mask"][0, :2] = 0
    torch.save(inputs, tmp_path / "io.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    child = subprocess.run(
        [sys.executable, "-c", REMOTE_CODE_CHILD, str(tmp_path / "model"), str(tmp_path / "io.pt")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    remote = torch.load(tmp_path / "io.pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    torch.testing.assert_close(remote["logits"], model(**inputs).logits)
    torch.testing.assert_close(remote["sequences"], out.sequences, rtol=0, atol=0)
    torch.testing.assert_close(remote["step_logits"], out.logits)


def test_post_init_draws_each_path_parameter_once(monkeypatch):
    """A model built from its config draws each PaTH weight once, in the order the converter's `init_path_parameters`
    draws a layer's, and the forget gate's bias is set after its Linear's own init (it is not 0)."""
    from transformers import initialization

    drawn = []
    normal_ = initialization.normal_

    def counting_normal_(tensor, *args, **kwargs):
        drawn.append(id(tensor))
        return normal_(tensor, *args, **kwargs)

    monkeypatch.setattr(initialization, "normal_", counting_normal_)
    config = tiny_model_config(path_forget_gate=True, path_forget_gate_bias=4.0, path_w_rank=4)
    model = PaTHLlamaForCausalLM(config)
    for layer in model.model.layers:
        attention = layer.self_attn
        path_weights = [p for n, p in attention.named_parameters() if n.startswith(("w_", "bt_proj", "g_proj"))]
        path_weights = [p for p in path_weights if p.dim() > 1]
        assert [drawn.count(id(p)) for p in path_weights] == [1] * len(path_weights)
        assert torch.all(attention.g_proj.bias == 4.0)
    drawn.clear()
    attention = PaTHLlamaAttention(config, layer_idx=0)
    init_path_parameters(attention, config)
    layer_zero = [id(p) for n, p in model.model.layers[0].self_attn.named_parameters()]
    fresh = [id(p) for n, p in attention.named_parameters()]
    order = {pid: i for i, pid in enumerate(fresh)}
    assert drawn == sorted(drawn, key=order.__getitem__) and len(drawn) == len(set(drawn)) > 0
    assert len(layer_zero) == len(fresh)


def test_right_padded_rows_decode_token_by_token_as_their_sequences_alone():
    """Right-padded rows fed one token at a time (padding included, masked out) and then decoded further: a padding
    step must transform nothing (beta and the forget gate masked) and feed nothing, or every later token of the
    shorter row sees it. Each row's logits are those of its own sequence run whole."""
    from transformers import DynamicCache

    # Without the convolution: its state steps over every slot, padding included (decoding after right padding is
    # for the transforms and the gate; generate pads on the left).
    model = tiny_model(rope_mode="keep", path_conv_size=0)
    lengths, new = (7, 4), 3
    sequences = [random_tokens(1, n + new, seed=n)[0] for n in lengths]
    T = max(lengths)
    ids = random_tokens(len(lengths), T + new, seed=3)  # real tokens under the padding: they must be ignored
    mask = torch.zeros_like(ids)
    for row, (s, n) in enumerate(zip(sequences, lengths, strict=True)):
        ids[row, :n], mask[row, :n] = s[:n], 1
        ids[row, T:], mask[row, T:] = s[n:], 1  # the decoded tokens, after the padding
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    logits = []
    for t in range(T + new):
        step = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], position_ids=positions[:, t : t + 1],
                     cache=cache, use_cache=True)  # fmt: skip
        logits.append(step.logits[:, -1])
    logits = torch.stack(logits, dim=1)
    for row, s in enumerate(sequences):
        assert max_rel_err(logits[row][mask[row].bool()], model(s[None]).logits[0]) < 1e-5, row
