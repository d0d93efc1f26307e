"""attn_implementation="flash_attn_ext" in a Hugging Face transformers model (issue 4's Show).

A small randomly initialised Llama-style decoder (GQA 4:2, 2 layers, no weight download) runs with
our attention and with transformers' "sdpa"; logits and every parameter gradient must meet the
error rule against a higher-precision "sdpa" model (float64 on the CPU, float32 on CUDA), with and
without left/right padding, in training mode (dropout 0), eagerly and under torch.compile, and
in strict mode: any attention call that a fused kernel does not serve raises.
"""

import copy

import pytest
import torch

import flash_attn_ext
from flash_attn_ext import dispatch
from reference import assert_error_rule

transformers = pytest.importorskip("transformers")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and
                     flash_attn_ext.ops.build_info()["cuda"] else [])
LOW = {"cpu": torch.float32, "cuda": torch.bfloat16}
TRUE = {"cpu": torch.float64, "cuda": torch.float32}


@pytest.fixture(autouse=True, scope="module")
def _registered():
    flash_attn_ext.register_transformers()


def make_models(device, seed=0):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   attention_dropout=0.0)
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(copy.deepcopy(cfg))
    models = {}
    for name, impl, dtype in (("ours", "flash_attn_ext", LOW[device]),
                              ("sdpa", "sdpa", LOW[device]), ("true", "sdpa", TRUE[device])):
        m = transformers.LlamaForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation=impl)
        m.load_state_dict(base.state_dict())
        models[name] = m.to(device=device, dtype=dtype).train()
    assert models["ours"].config._attn_implementation == "flash_attn_ext"
    assert models["sdpa"].config._attn_implementation == "sdpa"
    return models


def batch(device, padding):
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (3, 29), device=device)
    mask = torch.ones(3, 29, dtype=torch.long, device=device)
    if padding == "left":
        mask[0, :7] = 0
        mask[2, :1] = 0
    elif padding == "right":
        mask[0, -7:] = 0
        mask[1, -2:] = 0
    return ids, (None if padding == "none" else mask), mask.bool()


def run(model, ids, mask, valid, weights):
    """Logits at valid positions and the gradients of a weighted sum of them."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    loss = (logits.float()[valid] * weights).sum()
    loss.backward()
    return logits[valid].detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_llama_matches_sdpa(device, padding, compiled):
    models = make_models(device)
    ids, mask, valid = batch(device, padding)
    weights = torch.randn(int(valid.sum()), 97, device=device)
    if compiled:
        torch._dynamo.reset()
        models["ours"].forward = torch.compile(models["ours"].forward)
    dispatch.reset_fallback_counts()
    dispatch.set_strict(True)  # a fallback anywhere in the model raises
    try:
        ours = run(models["ours"], ids, mask, valid, weights)
    finally:
        dispatch.set_strict(None)
    plan = dispatch.last_plan()
    assert plan.fused and plan.backward_fused, plan
    assert dispatch.fallback_counts() == {}
    low = run(models["sdpa"], ids, mask, valid, weights)
    true = run(models["true"], ids, mask, valid, weights)
    assert_error_rule(ours[0], low[0], true[0].double(), 2.0, "logits")
    for name, g in ours[1].items():
        assert_error_rule(g, low[1][name], true[1][name].double(), 3.0, name)


def test_generate_matches_sdpa():
    models = make_models("cpu")
    ids, mask, _ = batch("cpu", "left")
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        ours = models["ours"].eval().generate(ids, **kw)
        ref = models["true"].eval().generate(ids, **kw)
    assert torch.equal(ours, ref)


def test_output_attentions_is_refused():
    models = make_models("cpu")
    ids, mask, _ = batch("cpu", "none")
    with pytest.raises(ValueError, match="output_attentions"):
        models["ours"](input_ids=ids, output_attentions=True)
