"""Hugging Face transformers: a tiny random DogeForCausalLM on dmattn against the stock eager Doge code (in each
way of switching it: `attn_implementation="dmattn"` when built or loaded, and `use_dmattn_for_doge`), the
"dmattn" attention implementation on Llama (padding masks and 4-D float masks), and the O(Sq * Sk) memory check
of the Doge top-k path.

Where the stock Doge code and the spec (docs/spec.md) differ, the tests stay where they agree:
- Ties: stock Doge selects keys with torch.topk, which breaks ties arbitrarily; SPEC §3 breaks them
  towards the larger key index. In layer 0 the bias depends on the token alone (dt_proj of the value
  projection of the embedding, no position), so a repeated token gives exactly tied biases. The
  forward/backward tests use sequences without repeated tokens; the generate test (whose output may
  repeat tokens) keeps all keys in layer 0 and has the top-k active in the other layers.
- Rows without an allowed key (queries at left-padding positions): stock Doge gives a near-uniform
  average (float32) or NaN (float64: its float32 softmax turns the float64 minimum into -inf), SPEC
  gives 0. Only the logits of real tokens are compared, and the loss ignores padding; padded runs use
  float32 so that the stock NaN does not reach the real tokens through 0 * NaN in later layers.
- Stock eager attention computes its softmax in float32 even for a float64 model, hence the 1e-5
  tolerances of the float64 comparisons.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DogeConfig, DogeForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaAttention, eager_attention_forward  # noqa: E402
from torch._C._profiler import _EventType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import reference  # noqa: E402
from dmattn.integrations.transformers import (  # noqa: E402
    ATTN_IMPLEMENTATION, dmattn_attention_forward, use_dmattn_for_doge)

VOCAB = 128
# Stock eager attention runs its softmax in float32 (see above); a top-k that picks other keys is off by ~1e-2.
FLOAT64_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def doge_config(keep_window_size, layers=2, sliding_window=None, attn_implementation="eager"):
    return DogeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, keep_window_size=keep_window_size,
                      sliding_window=sliding_window, max_position_embeddings=256,
                      attn_implementation=attn_implementation)


def stock_doge(dtype, keep_window_size, **config):
    """A stock eager DogeForCausalLM with non-zero random A."""
    stock = DogeForCausalLM(doge_config(keep_window_size, **config)).to(dtype)
    with torch.no_grad():
        for layer in stock.model.layers:
            layer.self_attn.A.normal_()
    return stock


def with_weights_of(model, stock):
    model.to(stock.dtype).load_state_dict(stock.state_dict())
    return model


def doge_switched(stock, config, path):
    return use_dmattn_for_doge(copy.deepcopy(stock))


def doge_built(stock, config, path):
    return with_weights_of(DogeForCausalLM(doge_config(**config, attn_implementation=ATTN_IMPLEMENTATION)), stock)


def doge_loaded(stock, config, path):
    stock.save_pretrained(path)
    return DogeForCausalLM.from_pretrained(path, attn_implementation=ATTN_IMPLEMENTATION, dtype=stock.dtype)


# The ways a Doge model comes to run on dmattn: (stock model, its config arguments, a folder) -> a dmattn twin.
DOGE_FORMS = {
    "use_dmattn_for_doge": doge_switched,
    "built_with_attn_implementation": doge_built,
    "from_pretrained_with_attn_implementation": doge_loaded,
}


@pytest.fixture(params=DOGE_FORMS)
def doge_pair(request, tmp_path):
    """make(dtype, keep_window_size, **config): a stock eager Doge and its dmattn twin, made in each of DOGE_FORMS."""
    def make(dtype, keep_window_size, **config):
        stock = stock_doge(dtype, keep_window_size, **config)
        ours = DOGE_FORMS[request.param](stock, dict(keep_window_size=keep_window_size, **config), tmp_path)
        assert ours.config._attn_implementation == ATTN_IMPLEMENTATION
        assert stock.config._attn_implementation == "eager"
        return stock, ours
    return make


def unique_tokens(batch, length):
    return torch.stack([torch.randperm(VOCAB)[:length] for _ in range(batch)])


def padding_mask(lengths, length, left):
    positions = torch.arange(length)
    mask = [(positions >= length - n) if left else (positions < n) for n in lengths]
    return torch.stack(mask).long()


def assert_same_run(stock, ours, ids, attention_mask, tolerance):
    """Logits of real tokens, and every parameter gradient of a loss of those logits, agree.

    (Not the language-model loss: its shifted labels make the last padding position predict the
    first real token.)
    """
    padding = attention_mask is not None and attention_mask.dim() == 2
    real = attention_mask.bool() if padding else torch.ones_like(ids, dtype=torch.bool)
    loss_weights = torch.randn(int(real.sum()), VOCAB, dtype=stock.dtype)
    runs = []
    for model in (stock, ours):
        model.zero_grad()
        logits = model(ids, attention_mask=attention_mask).logits
        (logits[real] * loss_weights).sum().backward()
        runs.append(logits)
    assert not torch.isnan(runs[1]).any()
    torch.testing.assert_close(runs[1][real], runs[0][real], **tolerance)
    for (name, p_stock), p_ours in zip(stock.named_parameters(), ours.parameters()):
        assert p_ours.grad is not None, name
        torch.testing.assert_close(p_ours.grad, p_stock.grad, **tolerance, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("keep_window_size", [64, 5], ids=["topk_off", "topk_on"])
def test_doge_logits_and_gradients_match_eager(doge_pair, keep_window_size):
    stock, ours = doge_pair(torch.float64, keep_window_size)
    assert_same_run(stock, ours, unique_tokens(2, 20), None, FLOAT64_TOLERANCE)


@pytest.mark.parametrize("left", [True, False], ids=["left_padding", "right_padding"])
def test_doge_padding_matches_eager(doge_pair, left):
    stock, ours = doge_pair(torch.float32, keep_window_size=5)
    mask = padding_mask([16, 11, 6], 16, left)
    assert_same_run(stock, ours, unique_tokens(3, 16), mask, dict(rtol=2e-4, atol=2e-5))


def test_doge_4d_float_mask_matches_eager(doge_pair):
    """A 4-D additive mask given to the model (causal, with more entries excluded) is the whole mask, read as
    the stock Doge code reads a float mask: 0 attends, anything else is excluded."""
    stock, ours = doge_pair(torch.float64, keep_window_size=5)
    S = 16
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    allowed = causal & (torch.rand(2, 1, S, S) < 0.7) | torch.eye(S, dtype=torch.bool)
    mask = torch.zeros(2, 1, S, S, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    assert_same_run(stock, ours, unique_tokens(2, S), mask, FLOAT64_TOLERANCE)


def test_doge_sliding_window_matches_eager(doge_pair):
    stock, ours = doge_pair(torch.float64, keep_window_size=4, sliding_window=7)
    assert_same_run(stock, ours, unique_tokens(2, 18), None, FLOAT64_TOLERANCE)


def test_doge_generate_with_kv_cache_matches_eager(doge_pair):
    stock, ours = doge_pair(torch.float32, keep_window_size=6, layers=3)
    for model in (stock, ours):
        model.model.layers[0].self_attn.keep_window_size = 1 << 20  # see the module docstring: ties
    ids = unique_tokens(2, 12)
    mask = padding_mask([12, 9], 12, left=True)
    results = [model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=0) for model in (stock, ours)]
    assert torch.equal(results[1].sequences, results[0].sequences)
    for ours_scores, stock_scores in zip(results[1].scores, results[0].scores):
        torch.testing.assert_close(ours_scores, stock_scores, rtol=2e-4, atol=2e-5)


def test_use_dmattn_for_doge_leaves_other_models_of_the_config_alone():
    """Models built from one config object share it: switching one must not switch the others."""
    config = doge_config(keep_window_size=5)
    first = DogeForCausalLM(config)
    with torch.no_grad():
        for layer in first.model.layers:
            layer.self_attn.A.normal_()
    second = with_weights_of(DogeForCausalLM(config), first)
    ids = unique_tokens(2, 12)
    before = second(ids).logits
    use_dmattn_for_doge(first)
    assert first.config._attn_implementation == ATTN_IMPLEMENTATION
    assert config._attn_implementation == second.config._attn_implementation == "eager"
    assert all(module.config is config for module in second.modules() if hasattr(module, "config"))
    torch.testing.assert_close(second(ids).logits, before, rtol=0, atol=0)
    torch.testing.assert_close(first(ids).logits, before, rtol=2e-4, atol=2e-5)


def llama_pair():
    """A tiny random eager LlamaForCausalLM and a copy of it on the "dmattn" attention implementation."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="eager")
    stock = LlamaForCausalLM(config)
    ours = copy.deepcopy(stock)
    ours.set_attn_implementation(ATTN_IMPLEMENTATION)
    return stock, ours


def test_llama_on_the_dmattn_attention_interface():
    stock, ours = llama_pair()
    assert ours.config._attn_implementation == ATTN_IMPLEMENTATION
    assert_same_run(stock, ours, torch.randint(0, VOCAB, (3, 14)), padding_mask([14, 10, 5], 14, left=True),
                    dict(rtol=2e-4, atol=2e-5))
    prompt = torch.randint(0, VOCAB, (1, 6))
    results = [model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0) for model in (stock, ours)]
    assert torch.equal(results[1], results[0])


def float_mask(B, sq, sk, dtype):
    """A learnable additive (B, 1, sq, sk) mask: finite values, -inf and the dtype's minimum, no row all excluded."""
    mask = torch.randn(B, 1, sq, sk, dtype=dtype)
    mask[torch.rand(mask.shape) < 0.2] = -torch.inf
    mask[torch.rand(mask.shape) < 0.2] = torch.finfo(dtype).min
    mask[..., 0] = 0.5
    return mask.requires_grad_()


@pytest.mark.parametrize("dtype,mask_dtype", [(torch.float64, torch.float64), (torch.float32, torch.float64)],
                         ids=["float64", "float64_mask_float32_q"])
def test_float_mask_on_the_attention_function_matches_eager(dtype, mask_dtype):
    """A 4-D float mask adds its finite values and excludes at -inf and the minimum, and is the whole mask (no
    causality added, as in eager); the mask gets its gradient."""
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    module = LlamaAttention(config, layer_idx=0)
    B, sq, sk = 2, 7, 9
    inputs = [torch.randn(B, heads, length, 8, dtype=dtype, requires_grad=True)
              for heads, length in ((4, sq), (2, sk), (2, sk))]
    mask = float_mask(B, sq, sk, mask_dtype)
    tolerance = FLOAT64_TOLERANCE if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    runs = []
    for attention_function in (eager_attention_forward, dmattn_attention_forward):
        leaves = [t.detach().clone().requires_grad_() for t in (*inputs, mask)]
        out = attention_function(module, *leaves, scaling=0.3)[0]
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
        runs.append([out] + [t.grad for t in leaves])
    for name, ours, eager in zip(["out", "dq", "dk", "dv", "dmask"], runs[1], runs[0]):
        assert torch.isfinite(ours).all(), name
        # eager runs its softmax in float32 (see the module docstring)
        torch.testing.assert_close(ours, eager, **tolerance, msg=lambda m: f"{name}: {m}")
    if dtype == torch.float64:
        q, k, v = (t.detach().transpose(1, 2) for t in inputs)
        expected, _ = reference.attention(q, k, v, mask > torch.finfo(mask.dtype).min, mask.detach(), scale=0.3)
        torch.testing.assert_close(runs[1][0], expected, rtol=1e-12, atol=1e-12)


def test_llama_with_a_4d_float_mask_matches_eager():
    """The mask as a model input: transformers hands a 4-D mask to the attention function as it is."""
    stock, ours = llama_pair()
    ids = torch.randint(0, VOCAB, (2, 10))
    mask = float_mask(2, 10, 10, torch.float32)
    runs = []
    for model in (stock, ours):
        model.zero_grad()
        leaf = mask.detach().clone().requires_grad_()
        logits = model(ids, attention_mask=leaf).logits
        (logits * torch.linspace(-1, 1, logits.numel()).view(logits.shape)).sum().backward()
        runs.append((logits, leaf.grad, [p.grad for p in model.parameters()]))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=2e-4, atol=2e-5)
    for ours_grad, stock_grad in zip(runs[1][2], runs[0][2]):
        torch.testing.assert_close(ours_grad, stock_grad, rtol=2e-4, atol=2e-5)


def largest_allocations(run):
    """Sizes in bytes of every allocation torch's memory profiler saw during run(), largest first."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True) as prof:
        run()
    sizes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.alloc_size > 0:
            sizes.append(event.extra_fields.alloc_size)
        stack.extend(event.children)
    return sorted(sizes, reverse=True)


def test_doge_topk_path_allocates_nothing_of_size_sq_sk():
    """Forward and backward at S = 4096 with top-k active: every allocation is far below S * S bytes."""
    S = 4096
    config = DogeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, keep_window_size=64,
                        max_position_embeddings=S, attn_implementation="eager")
    model = DogeForCausalLM(config)
    with torch.no_grad():
        model.model.layers[0].self_attn.A.normal_()
    use_dmattn_for_doge(model)
    ids = torch.randint(0, 64, (1, S))
    mask = torch.ones(1, S, dtype=torch.long)
    sizes = largest_allocations(lambda: model(ids, attention_mask=mask, labels=ids).loss.backward())
    # One bool (S, S) tensor is S * S bytes; the largest tensors here are (S, hidden) activations.
    assert sizes[0] <= S * S // 16, f"largest allocation {sizes[0]} bytes at S = {S}"
