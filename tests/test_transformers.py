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
import torch.nn.functional as F

import flash_attn_ext
from flash_attn_ext import policy
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
    policy.reset_fallback_counts()
    policy.set_strict(True)  # a fallback anywhere in the model raises
    try:
        ours = run(models["ours"], ids, mask, valid, weights)
    finally:
        policy.set_strict(None)
    if not compiled:  # compiled calls are not recorded (strict mode covered them)
        plan = policy.last_plan()
        assert plan.fused and plan.backward_fused, plan
    assert policy.fallback_counts() == {}
    low = run(models["sdpa"], ids, mask, valid, weights)
    true = run(models["true"], ids, mask, valid, weights)
    assert_error_rule(ours[0], low[0], true[0].double(), 2.0, "logits")
    for name, g in ours[1].items():
        assert_error_rule(g, low[1][name], true[1][name].double(), 3.0, name)


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device and a CUDA build")
@pytest.mark.skipif(not hasattr(torch.nn.attention, "activate_flash_attention_impl"),
                    reason="this torch has no flash attention registry")
def test_sdpa_model_on_pytorch_flash_provider_matches_ours():
    # attn_implementation="sdpa" unchanged, our kernels behind SDPA's FLASH backend
    # (activate_flash_attention_impl + sdpa_kernel): logits and gradients under the error rule
    # against float32, as attn_implementation="flash_attn_ext"'s are, with PyTorch's own
    # kernels (the same model before the activation) as the yardstick of both.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flash_attn_ext.integrations import torch_flash

    models = make_models("cuda")
    ids, mask, valid = batch("cuda", "none")
    weights = torch.randn(int(valid.sum()), 97, device="cuda")
    ours = run(models["ours"], ids, mask, valid, weights)
    low = run(models["sdpa"], ids, mask, valid, weights)
    torch.nn.attention.activate_flash_attention_impl(torch_flash.NAME)
    try:
        policy._last_plan = None
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            provider = run(models["sdpa"], ids, mask, valid, weights)
        plan = policy.last_plan()
    finally:
        torch.nn.attention.restore_flash_attention_impl()
    assert plan is not None and plan.kernel.startswith("sm"), plan  # (ours ran)
    true = run(models["true"], ids, mask, valid, weights)
    for who, result in (("provider", provider), ("ours", ours)):
        assert_error_rule(result[0], low[0], true[0].double(), 2.0, f"{who}: logits")
        for name, g in result[1].items():
            assert_error_rule(g, low[1][name], true[1][name].double(), 3.0, f"{who}: {name}")


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


def _build(cls, cfg, impl):
    torch.manual_seed(0)
    return cls._from_config(copy.deepcopy(cfg), attn_implementation=impl,
                            dtype=torch.float64).eval()


def test_t5_position_bias_is_applied():
    cfg = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                num_heads=4, decoder_start_token_id=0)
    ids = torch.randint(0, 128, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    dec = torch.randint(0, 128, (2, 6))
    logits = {impl: _build(transformers.T5ForConditionalGeneration, cfg, impl)(
        input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        for impl in ("sdpa", "flash_attn_ext")}
    assert (logits["flash_attn_ext"] - logits["sdpa"]).abs().max().item() < 1e-10


def test_gemma2_softcap_reaches_the_kernel():
    cfg = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16,
                                    attn_logit_softcapping=5.0, sliding_window=5,
                                    initializer_range=0.3)
    ids = torch.randint(0, 128, (2, 12))
    logits = {impl: _build(transformers.Gemma2ForCausalLM, cfg, impl)(input_ids=ids).logits
              for impl in ("eager", "flash_attn_ext")}
    # eager takes its softmax in float32: agreement to float32 rounding.
    assert (logits["flash_attn_ext"] - logits["eager"]).abs().max().item() < 1e-4


def test_packed_sequences_do_not_attend_across():
    # What models that special-case FlashAttention pass instead of a mask (e.g. Qwen2-VL's
    # vision tower): cu_seq_lens.
    from flash_attn_ext.integrations.transformers import attention_forward

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 10, 8, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 3, 10])
    module = torch.nn.Module()
    for causal in (False, True):
        ref = torch.cat([F.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=causal)
            for a, b in ((0, 3), (3, 10))], dim=2).transpose(1, 2)
        out, _ = attention_forward(module, q, k, v, None, is_causal=causal, cu_seq_lens_q=cu,
                                   cu_seq_lens_k=cu)
        assert (out - ref).abs().max().item() < 1e-12
    with pytest.raises(NotImplementedError, match="s_aux"):
        attention_forward(module, q, k, v, None, s_aux=torch.zeros(4))


@pytest.mark.parametrize("device", DEVICES)
def test_sequences_packed_by_position_ids_do_not_attend_across(device):
    # What DataCollatorWithFlattening produces: one row, positions restarting at 0 per
    # sequence, no mask.  With a cache (training mode, default use_cache) transformers' mask
    # functions pass no mask, and the sequences attended to each other (new-user trial: 0.5 in
    # the logits); FlashAttention-2's integration reads the positions, and so do we.
    model = make_models(device)["ours"]
    torch.manual_seed(2)
    lengths = [7, 12, 1, 9]
    ids = torch.randint(0, 97, (1, sum(lengths)), device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits[0]
        alone = torch.cat([model(input_ids=part[None]).logits[0]
                           for part in ids[0].split(lengths)])
    tol = 1e-4 if device == "cpu" else 5e-2
    assert (packed.float() - alone.float()).abs().max().item() < tol
    # consecutive positions are one sequence (plain causal attention)
    from flash_attn_ext.integrations.transformers import _offsets_from_positions
    q = torch.zeros(1, 2, 5, 4)
    assert _offsets_from_positions(q, q, torch.arange(3, 8)[None]) is None
    assert _offsets_from_positions(q, q, torch.tensor([[4, 5, 0, 1, 2]])).tolist() == [0, 2, 5]
    assert _offsets_from_positions(q, q, torch.tensor([[0, 1, 0, 0, 1]])).tolist() == \
        [0, 2, 3, 5]
    assert _offsets_from_positions(q[:, :, :1], q, torch.tensor([[0]])) is None  # (decoding)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bounds", [[0, 5, 17, 40, 40, 113], [0, 113]],
                         ids=["five_sequences", "one_sequence"])
def test_packed_sequences_route_forward_and_gradients(device, bounds):
    # The route the integration takes for cu_seq_lens on each device (several sequences: the
    # packed-sequence kernels; one sequence on CUDA: a block-diagonal mask), forward and
    # gradients under the error rule against per-sequence attention in higher precision, with
    # an empty sequence and transformers' max_length_q/k given.
    from flash_attn_ext.integrations.transformers import attention_forward

    torch.manual_seed(1)
    low, true = LOW[device], TRUE[device]
    base = [torch.randn(1, h, 113, 40, dtype=true, device=device) for h in (4, 2, 2)]
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    dout = torch.randn(1, 113, 4, 40, dtype=true, device=device)

    def run(dtype, ours):
        q, k, v = (t.to(dtype).requires_grad_() for t in base)
        if ours:
            out, _ = attention_forward(torch.nn.Module(), q, k, v, None, is_causal=True,
                                       cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                       max_length_q=longest, max_length_k=longest)
        else:
            kr, vr = (t.repeat_interleave(2, 1) for t in (k, v))
            out = torch.cat([F.scaled_dot_product_attention(
                q[:, :, a:b], kr[:, :, a:b], vr[:, :, a:b], is_causal=True)
                for a, b in zip(bounds, bounds[1:])], dim=2).transpose(1, 2)
        out.backward(dout.to(dtype))
        return [out.detach()] + [t.grad for t in (q, k, v)]

    policy.set_strict(True)  # a fallback raises
    try:
        ours = run(low, True)
    finally:
        policy.set_strict(None)
    lows, trues = run(low, False), run(true, False)
    for name, o, lo, tr in zip(["out", "dq", "dk", "dv"], ours, lows, trues):
        assert_error_rule(o.to(true), lo.to(true), tr, 2.0 if name == "out" else 3.0, name)


def test_packed_offsets_copied_to_the_host_once_per_tensor_and_version():
    # Every layer of a forward pass gets the same cu_seq_lens tensors: their host copy (on
    # CUDA a synchronisation) is made once and reused while neither tensor changes; an
    # in-place change (version counter) or another tensor is a new copy.
    from flash_attn_ext.integrations.transformers import _host_offsets

    cu_q = torch.tensor([0, 3, 9], dtype=torch.int64)
    cu_k = torch.tensor([0, 4, 11], dtype=torch.int32)
    first = _host_offsets(cu_q, cu_k)
    assert [t.dtype for t in first] == [torch.int32, torch.int32]
    assert first[0].tolist() == [0, 3, 9] and first[1].tolist() == [0, 4, 11]
    again = _host_offsets(cu_q, cu_k)
    assert again[0] is first[0] and again[1] is first[1]
    cu_k[2] = 12  # in place: the version changes
    changed = _host_offsets(cu_q, cu_k)
    assert changed[1].tolist() == [0, 4, 12] and changed[0] is not first[0]
    other = torch.tensor([0, 4, 10], dtype=torch.int32)
    assert _host_offsets(cu_q, other)[1].tolist() == [0, 4, 10]
    with torch.inference_mode():  # (no version counter: never cached)
        cu_i = torch.tensor([0, 2], dtype=torch.int32)
        a, b = _host_offsets(cu_i, cu_i), _host_offsets(cu_i, cu_i)
        assert a[0] is not b[0] and a[0].tolist() == [0, 2]


@pytest.mark.parametrize("route", ["varlen", "mask"])
def test_packed_sequences_packed_differently_are_causal_within_each(route):
    # q lengths [0, 1, 0, 1] against k lengths [0, 3, 0, 5] (decoding against packed
    # caches): causal is bottom-right within each sequence, so the last query sees all 5 of
    # its keys (one top-left triangle over the packed matrix gave it none: zeros).  "varlen":
    # attention_forward on the CPU (the packed kernels); "mask": the mask other devices get.
    from flash_attn_ext.integrations.transformers import (
        _packed_sequence_mask,
        attention_forward,
    )

    torch.manual_seed(0)
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 8, 8, dtype=torch.float64) for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 0, 1, 1, 2]), torch.tensor([0, 0, 3, 3, 8])
    kw = dict(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k)
    if route == "varlen":
        out, _ = attention_forward(torch.nn.Module(), q, k, v, None, is_causal=True, **kw)
    else:
        mask = _packed_sequence_mask(q, k, kw, causal=True)
        out = flash_attn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                          enable_gqa=True).transpose(1, 2)
    kr, vr = (t.repeat_interleave(2, 1) for t in (k, v))
    ref = torch.cat([F.scaled_dot_product_attention(q[:, :, 0:1], kr[:, :, 0:3], vr[:, :, 0:3]),
                     F.scaled_dot_product_attention(q[:, :, 1:2], kr[:, :, 3:8], vr[:, :, 3:8])],
                    dim=2).transpose(1, 2)
    assert (out - ref).abs().max().item() < 1e-12


def test_sdpa_named_registration_for_models_that_special_case_flash():
    # Pixtral's vision tower drops its block mask for any "flash" name; "fae_sdpa" keeps it.
    cfg = transformers.PixtralVisionConfig(hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=2, num_attention_heads=4,
                                           image_size=32, patch_size=8, head_dim=16)
    pixels = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    sizes = torch.tensor([[32, 32], [16, 24]])
    hidden = {impl: _build(transformers.PixtralVisionModel, cfg, impl)(
        pixel_values=pixels, image_sizes=sizes).last_hidden_state
        for impl in ("sdpa", "fae_sdpa")}
    assert (hidden["fae_sdpa"] - hidden["sdpa"]).abs().max().item() < 1e-10


@pytest.mark.parametrize("first", ["flash_attn_ext", "transformers"])
def test_registration_does_not_depend_on_import_order(first):
    # A fresh interpreter: flash_attn_ext imported before transformers (isort's order) registers
    # through an import hook on transformers.modeling_utils; after it, at once.
    import subprocess
    import sys
    import textwrap

    second = "transformers" if first == "flash_attn_ext" else "flash_attn_ext"
    code = textwrap.dedent(f"""
        import {first}
        import {second}
        import torch
        cfg = transformers.LlamaConfig(vocab_size=31, hidden_size=32, intermediate_size=48,
                                       num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1)
        m = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="flash_attn_ext")
        m(torch.randint(0, 31, (1, 5)))
        print(flash_attn_ext.last_plan().kernel)
        """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().startswith("cpu_flash_fwd"), run.stdout


def _packed_row(device):
    """One row of three sequences (5, 7, 4 tokens): ids, their position_ids and cu_seq_lens."""
    torch.manual_seed(3)
    lengths = (5, 7, 4)
    ids = torch.randint(0, 97, (1, sum(lengths)), device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32, device=device)
    return ids, lengths, positions, cu


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_kind", ["llama_compiled", "mistral_window",
                                        "mistral_window_cache"])
def test_packed_sequences_with_a_mask_do_not_attend_across(device, model_kind):
    # transformers hands a mask as well as the packing: under torch.compile its causal mask,
    # sliding-window models (eager) their window's.  The offsets and the positions were then
    # ignored and the sequences attended to each other (new-user trial: 0.55 in the logits);
    # the mask is now narrowed to the sequences.
    ids, lengths, positions, cu = _packed_row(device)
    if model_kind == "llama_compiled":
        model = make_models(device)["ours"].eval()
        packed_call = torch.compile(model)
    else:
        cfg = transformers.MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=128,
                                         sliding_window=4)
        torch.manual_seed(0)
        model = transformers.MistralForCausalLM._from_config(
            cfg, attn_implementation="flash_attn_ext").to(device=device, dtype=LOW[device])
        # Training mode (no cache); and evaluation with transformers' default cache, where its
        # mask function builds the window over the whole row (a new-user trial: every
        # sequence after the first was wrong by 0.3-0.7 in the logits).
        packed_call = model.eval() if model_kind == "mistral_window_cache" else model.train()
    with torch.no_grad():
        alone = torch.cat([model(input_ids=part[None]).logits[0]
                           for part in ids[0].split(list(lengths))])
        tol = 1e-4 if device == "cpu" else 5e-2
        for kwargs in ({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 7,
                        "max_length_k": 7}, {}):
            packed = packed_call(input_ids=ids, position_ids=positions, **kwargs).logits[0]
            assert (packed.float() - alone.float()).abs().max().item() < tol, kwargs


def test_head_dims_beyond_the_kernels_fall_back_in_the_integration():
    # Head dim 288: the SDPA drop-in runs the unfused math (a reported fallback), but the
    # integration called the kernels' path and raised (new-user trial).  Now the same
    # fallback: warned, counted, refused in strict mode.
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=288)
    torch.manual_seed(0)
    ours = transformers.LlamaForCausalLM._from_config(copy.deepcopy(cfg),
                                                      attn_implementation="flash_attn_ext")
    ref = transformers.LlamaForCausalLM._from_config(copy.deepcopy(cfg),
                                                     attn_implementation="sdpa")
    ref.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 97, (2, 12))
    policy.reset_fallback_counts()
    with pytest.warns(UserWarning, match="falling back.*head_dim=288"):
        out = ours(input_ids=ids).logits
    torch.testing.assert_close(out, ref(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
    assert sum(policy.fallback_counts().values()) >= 1
    policy.set_strict(True)
    try:
        with pytest.raises(flash_attn_ext.FallbackError):
            ours(input_ids=ids)
    finally:
        policy.set_strict(None)
        policy.reset_fallback_counts()


@pytest.mark.parametrize("config", ["CodeGenConfig", "BloomConfig", "GPTJConfig"])
def test_models_that_compute_attention_themselves_refuse_the_name(config):
    """A model that does not support SDPA-style attention (its own attention code, not the
    attention interface) refuses attn_implementation="flash_attn_ext" with a ValueError that
    says why, as "fae_sdpa" and "sdpa" are refused: transformers accepted the name for any
    model, our kernels never ran, and the model's own attention took our boolean masks as
    additive ones (CodeGen's causal LM saw later tokens; a new-user finding).  A model that
    does support it is unaffected."""
    cfg = getattr(transformers, config)(vocab_size=97, hidden_size=64, n_embd=64, n_layer=2,
                                        n_head=4, num_hidden_layers=2, num_attention_heads=4,
                                        n_positions=64, rotary_dim=8)
    with pytest.raises(ValueError, match="does not support attn_implementation='flash_attn_ext'"):
        transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="flash_attn_ext")
    with pytest.raises(ValueError):
        transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="fae_sdpa")
    transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    llama = make_models("cpu")["ours"]
    assert llama.config._attn_implementation == "flash_attn_ext"
