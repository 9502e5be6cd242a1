"""dmattn_cute as a transformers attention implementation (dmattn_cute/integrations/
transformers.py): tiny random models give the logits and greedy tokens of transformers' own
"eager" / "sdpa" attention on the same weights, with padding, GQA, softcap, sliding window,
the kv cache (dynamic and static) and torch.compile; the dynamic-mask path (attention_bias,
keep_window_size) equals the reference with a mask built by hand.

Our kernels take bf16/fp16 only, on CPU too (the float32 reference runs inside, the output is
rounded to the input dtype), so models run in bf16 or fp16. Their logits are judged by SPEC.md's
rule against the same model in float32 with eager attention: our error may be at most twice
that of transformers' own attention in the same low precision (+1e-5). Errors are taken over
real tokens only: a left-padded query row sees no key, which we answer with 0 and eager with an
average of pad values, both meaningless. Greedy tokens are compared with transformers' sdpa
computed in float32, as our CPU path computes, so that roundings do not decide near-ties.
"""

from __future__ import annotations

import ast
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from transformers import (
    AttentionInterface,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    StaticCache,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface,
    sdpa_mask,
    sliding_window_bidirectional_mask_function,
    sliding_window_causal_mask_function,
)

from dmattn_cute.integrations.transformers import ATTN_IMPLEMENTATION, attention_forward, register
from dmattn_cute.reference import attention_ref

ROOT = Path(__file__).resolve().parent.parent
VOCAB, SEQLEN = 128, 12
SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA: two query heads per kv head
    "head_dim": 16,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": None,
    "eos_token_id": None,
}


def llama() -> nn.Module:
    return LlamaForCausalLM(LlamaConfig(**SMALL))


def gemma2() -> nn.Module:
    """Gemma 2: a scale that is not 1/sqrt(D), a softcap that changes the scores (weights 10x
    the default init, so that scores reach a few units), and a sliding window shorter than the
    sequence on its first layer."""
    config = Gemma2Config(
        **SMALL,
        initializer_range=0.2,
        query_pre_attn_scalar=7,
        attn_logit_softcapping=0.5,
        final_logit_softcapping=None,
        sliding_window=4,
    )
    return Gemma2ForCausalLM(config)


# (model, transformers' implementation to compare with): sdpa refuses a softcap.
MODELS = {
    "llama-eager": (llama, "eager"),
    "llama-sdpa": (llama, "sdpa"),
    "gemma2": (gemma2, "eager"),
}


def sdpa_in_float32(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention computed in float32, its output rounded to the inputs'
    dtype: what our CPU path computes (the float32 reference), by other code."""
    out, _ = sdpa_attention_forward(
        module, query.float(), key.float(), value.float(), attention_mask, **kwargs
    )
    return out.to(query.dtype), None


SDPA_FLOAT32 = "sdpa_float32"


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    register()
    AttentionInterface.register(SDPA_FLOAT32, sdpa_in_float32)
    AttentionMaskInterface.register(SDPA_FLOAT32, sdpa_mask)


def variant(model: nn.Module, implementation: str, dtype: torch.dtype) -> nn.Module:
    """A copy of `model` in `dtype` whose attention layers use `implementation`."""
    copied = copy.deepcopy(model).to(dtype)
    copied.set_attn_implementation(implementation)
    return copied


def padded_batch(device: str = "cpu") -> tuple[Tensor, Tensor]:
    """Three prompts: full length, left-padded by 4, right-padded by 3."""
    input_ids = torch.randint(1, VOCAB, (3, SEQLEN), device=device)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0
    attention_mask[2, -3:] = 0
    return input_ids, attention_mask


def assert_within_rule(ours: Tensor, peer: Tensor, truth: Tensor, where: Tensor) -> None:
    """SPEC.md's rule: max|ours - truth| <= 2 max|peer - truth| + 1e-5 over `where`."""
    ours_err = (ours.float() - truth.float())[where].abs().max().item()
    peer_err = (peer.float() - truth.float())[where].abs().max().item()
    assert ours_err <= 2 * peer_err + 1e-5, f"ours {ours_err:.3g} vs peer {peer_err:.3g}"


@torch.no_grad()
def check_logits(make_model, peer: str, dtype: torch.dtype, device: str) -> None:
    model = make_model().to(device).eval()
    input_ids, attention_mask = padded_batch(device)
    truth = variant(model, "eager", torch.float32)(input_ids, attention_mask=attention_mask)
    logits = {
        implementation: variant(model, implementation, dtype)(
            input_ids, attention_mask=attention_mask
        ).logits
        for implementation in (ATTN_IMPLEMENTATION, peer)
    }
    assert_within_rule(
        logits[ATTN_IMPLEMENTATION], logits[peer], truth.logits, attention_mask.bool()
    )


@pytest.mark.parametrize(("make_model", "peer"), MODELS.values(), ids=MODELS.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_logits_match_transformers_attention(make_model, peer, dtype) -> None:
    check_logits(make_model, peer, dtype, "cpu")


# Unpadded with a dynamic cache, transformers passes no mask at all (decode: is_causal alone).
GENERATE = {
    "padded": (True, "dynamic"),
    "unpadded": (False, "dynamic"),
    "static": (False, "static"),
}


@pytest.mark.parametrize(("padded", "cache"), GENERATE.values(), ids=GENERATE.keys())
def test_greedy_generate_with_kv_cache_matches_sdpa(padded, cache) -> None:
    """Greedy generate(): a prefill, then decode steps of one query against the whole cache
    (causal is bottom-right aligned). The peer is transformers' sdpa attention computed in
    float32: plain fp16 sdpa moves these random logits by as much as their smallest top-2 gaps
    (~5e-4), which would make the tokens a coin toss at near-ties. A static cache also runs the
    prefill that transformers gives no mask (the keys past the prompt are empty slots)."""
    model = llama().eval()
    input_ids = torch.randint(1, VOCAB, (3, SEQLEN))
    attention_mask = torch.ones_like(input_ids)
    if padded:  # generation pads on the left
        attention_mask[1, :4] = 0
        attention_mask[2, :7] = 0
    generate = {
        "attention_mask": attention_mask,
        "max_new_tokens": 10,
        "do_sample": False,
        "cache_implementation": cache,
        "return_dict_in_generate": True,
        "output_logits": True,
    }
    runs = {
        implementation: variant(model, implementation, torch.float16).generate(
            input_ids, **generate
        )
        for implementation in (ATTN_IMPLEMENTATION, SDPA_FLOAT32)
    }
    assert torch.equal(runs[ATTN_IMPLEMENTATION].sequences, runs[SDPA_FLOAT32].sequences)
    ours, peer = (torch.stack(runs[name].logits, 1) for name in (ATTN_IMPLEMENTATION, SDPA_FLOAT32))
    # The same arithmetic but for the order of float32 sums: an fp16 attention output now and
    # then one ulp apart, logits (|x| < 1) a few fp16 ulps (4.9e-4 at 0.5) apart at most.
    torch.testing.assert_close(ours, peer, atol=2e-3, rtol=0)


def test_training_gradients_match_sdpa() -> None:
    """A language-model loss on a padded batch: every parameter's gradient (through our
    backward op) within the rule against the float32 model, peer sdpa in bf16."""
    model = llama().train()
    input_ids, attention_mask = padded_batch()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    grads = {}
    for implementation, dtype in (
        ("eager", torch.float32),
        ("sdpa", torch.bfloat16),
        (ATTN_IMPLEMENTATION, torch.bfloat16),
    ):
        copied = variant(model, implementation, dtype)
        copied(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
        grads[implementation] = {name: p.grad for name, p in copied.named_parameters()}
    for name, truth in grads["eager"].items():
        everywhere = torch.ones_like(truth, dtype=torch.bool)
        assert_within_rule(grads[ATTN_IMPLEMENTATION][name], grads["sdpa"][name], truth, everywhere)


@torch.no_grad()
def test_compiled_prefill_and_decode_have_no_graph_break_and_match() -> None:
    """torch.compile(fullgraph=True) of a prefill and a decode step into a static cache, as
    compiled generation runs them; the truth is the float32 model on the whole sequence."""
    model = llama().eval()
    input_ids, attention_mask = padded_batch()
    next_ids = torch.randint(1, VOCAB, (3, 1))
    full_ids = torch.cat([input_ids, next_ids], dim=1)
    full_mask = torch.cat([attention_mask, torch.ones_like(next_ids)], dim=1)
    truth = variant(model, "eager", torch.float32)(full_ids, attention_mask=full_mask).logits
    peer = variant(model, "eager", torch.bfloat16)(full_ids, attention_mask=full_mask).logits
    torch._dynamo.reset()
    compiled = torch.compile(variant(model, ATTN_IMPLEMENTATION, torch.bfloat16), fullgraph=True)
    cache = StaticCache(config=model.config, max_cache_len=2 * SEQLEN)
    prefill = compiled(input_ids, attention_mask=attention_mask, past_key_values=cache).logits
    decode = compiled(next_ids, attention_mask=full_mask, past_key_values=cache).logits
    ours = torch.cat([prefill, decode], dim=1)
    assert_within_rule(ours, peer, truth, full_mask.bool())


class Module(nn.Module):
    """The attention module transformers passes as the first argument."""

    def __init__(self, is_causal: bool = True) -> None:
        super().__init__()
        self.is_causal = is_causal


def top_keys_by_hand(bias: Tensor, visible: Tensor, keep: int, group: int) -> Tensor:
    """mask [B, H, Sq, Sk]: per query row, the `keep` visible keys of largest bias, by sorting.
    bias [B, Hkv, Sq or 1, Sk] float32 (no ties), visible [B, 1, Sq, Sk] bool."""
    batch, _, seqlen_q, seqlen_k = visible.shape
    mask = torch.zeros(batch, bias.shape[1] * group, seqlen_q, seqlen_k, dtype=torch.bool)
    for b, h, i in torch.cartesian_prod(
        torch.arange(batch), torch.arange(mask.shape[1]), torch.arange(seqlen_q)
    ).tolist():
        row = bias[b, h // group, min(i, bias.shape[2] - 1)]
        keys = [j for j in range(seqlen_k) if visible[b, 0, i, j]]
        for j in sorted(keys, key=lambda j: -row[j].item())[:keep]:
            mask[b, h, i, j] = True
    return mask


# (Sq, Sk, padding, bias per query row): prefill, prefill of a padded batch (transformers'
# bool mask), decode (one query, the whole cache), a bias with a row per query.
DYNAMIC = {
    "prefill": (10, 10, False, False),
    "prefill-padded": (10, 10, True, False),
    "decode": (1, 14, True, False),
    "bias-per-query": (10, 10, True, True),
}


@pytest.mark.parametrize(("seqlen_q", "seqlen_k", "padded", "per_query"), DYNAMIC.values(),
                         ids=DYNAMIC.keys())  # fmt: skip
def test_dynamic_mask_path_matches_hand_built_mask(seqlen_q, seqlen_k, padded, per_query) -> None:
    """attention_bias + keep_window_size: each query keeps its 4 largest-bias keys among those
    it sees (causal-aware: a query never spends its budget on future keys)."""
    batch, heads, heads_kv, head_dim, keep = 2, 4, 2, 16, 4
    query = torch.randn(batch, heads, seqlen_q, head_dim, dtype=torch.bfloat16)
    key = torch.randn(batch, heads_kv, seqlen_k, head_dim, dtype=torch.bfloat16)
    value = torch.randn(batch, heads_kv, seqlen_k, head_dim, dtype=torch.bfloat16)
    bias_rows = seqlen_q if per_query else 1
    bias = torch.randn(batch, heads_kv, bias_rows, seqlen_k)  # float32: no ties in the top-k
    rows = torch.arange(seqlen_q).unsqueeze(1) + seqlen_k - seqlen_q
    visible = (torch.arange(seqlen_k) <= rows).expand(batch, 1, seqlen_q, seqlen_k).clone()
    mask = None
    if padded:  # the second sequence starts 3 keys late: what transformers' mask says
        visible[1, :, :, :3] = False
        mask = visible
    out, weights = attention_forward(
        Module(),
        query,
        key,
        value,
        mask,
        scaling=0.3,
        attention_bias=bias if per_query else bias.squeeze(2),
        keep_window_size=keep,
    )
    expected_mask = top_keys_by_hand(bias, visible, keep, heads // heads_kv)
    assert not expected_mask[visible.expand_as(expected_mask)].all()  # the top-k drops keys
    expected, _ = attention_ref(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        attn_mask=expected_mask, attn_bias=bias, softmax_scale=0.3,
    )  # fmt: skip
    assert weights is None
    assert out.shape == (batch, seqlen_q, heads, head_dim) and out.dtype == torch.bfloat16
    seen = visible.any(-1).transpose(1, 2).squeeze(-1)  # [B, Sq]: rows with a visible key
    torch.testing.assert_close(out[seen], expected.to(torch.bfloat16)[seen])


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), [(10, 10), (1, 10)], ids=["prefill", "decode"])
def test_sliding_window_without_mask_is_transformers_window(is_causal, seqlen_q, seqlen_k) -> None:
    """Without a mask, sliding_window limits the keys as transformers' own mask functions do."""
    window = 3
    query = torch.randn(2, 4, seqlen_q, 16, dtype=torch.bfloat16)
    key = torch.randn(2, 2, seqlen_k, 16, dtype=torch.bfloat16)
    value = torch.randn(2, 2, seqlen_k, 16, dtype=torch.bfloat16)
    draw = (
        sliding_window_causal_mask_function
        if is_causal
        else sliding_window_bidirectional_mask_function
    )
    mask = sdpa_mask(
        batch_size=2,
        q_length=seqlen_q,
        kv_length=seqlen_k,
        q_offset=seqlen_k - seqlen_q,
        mask_function=draw(window),
        allow_is_causal_skip=False,
    )
    out, _ = attention_forward(Module(is_causal), query, key, value, None, sliding_window=window)
    expected, _ = attention_ref(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask
    )
    torch.testing.assert_close(out, expected.to(torch.bfloat16))


def test_additive_float_mask_is_a_bias() -> None:
    """An additive mask (eager's 0 / finfo.min kind, or any float) is added to the scores."""
    query = torch.randn(2, 4, 6, 16, dtype=torch.bfloat16)
    key = torch.randn(2, 2, 6, 16, dtype=torch.bfloat16)
    value = torch.randn(2, 2, 6, 16, dtype=torch.bfloat16)
    additive = torch.randn(2, 1, 6, 6, dtype=torch.bfloat16)
    additive[1, :, :, :2] = torch.finfo(torch.bfloat16).min
    out, _ = attention_forward(Module(), query, key, value, additive)
    expected, _ = attention_ref(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_bias=additive
    )
    torch.testing.assert_close(out, expected.to(torch.bfloat16))


def test_float32_model_runs_under_autocast_and_is_refused_outside() -> None:
    model = llama().eval()
    input_ids, attention_mask = padded_batch()
    ours = variant(model, ATTN_IMPLEMENTATION, torch.float32)
    with pytest.raises(TypeError, match=r"torch.float32.*dtype=torch.bfloat16.*autocast"):
        ours(input_ids, attention_mask=attention_mask)
    peer = variant(model, "sdpa", torch.float32)
    with torch.no_grad():
        truth = variant(model, "eager", torch.float32)(input_ids, attention_mask=attention_mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = ours(input_ids, attention_mask=attention_mask).logits
            peer_logits = peer(input_ids, attention_mask=attention_mask).logits
    assert_within_rule(logits, peer_logits, truth.logits, attention_mask.bool())


def test_attention_dropout_in_training_raises() -> None:
    config = LlamaConfig(**SMALL, attention_dropout=0.1)
    model = LlamaForCausalLM(config).to(torch.bfloat16).train()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    input_ids, _ = padded_batch()
    with pytest.raises(ValueError, match=r"dropout=0\.1.*attention_dropout"):
        model(input_ids)
    model.eval()(input_ids)  # no dropout asked for in eval mode


UNSUPPORTED = {
    "keep-without-bias": ({"keep_window_size": 2}, "keep_window_size: needs attention_bias"),
    "sinks": ({"s_aux": torch.zeros(2)}, r"attention sinks \(s_aux\)"),
    "paged-cache": ({"cache": object()}, "continuous batching"),
}


@pytest.mark.parametrize(("kwargs", "message"), UNSUPPORTED.values(), ids=UNSUPPORTED.keys())
def test_unsupported_arguments_raise(kwargs, message) -> None:
    q = torch.randn(1, 2, 4, 16, dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        attention_forward(Module(), q, kv, kv, None, **kwargs)


def test_importing_dmattn_cute_does_not_import_transformers() -> None:
    code = (
        "import sys, dmattn_cute, dmattn_cute.integrations.transformers; "
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_example_runs() -> None:
    """The example generates with each of its three models (its bf16 tokens are not compared:
    near-ties decide some of them, see the generate test)."""
    script = ROOT / "examples" / "transformers_generate.py"
    # the package of this tree, installed or not (a script's own folder leads its sys.path)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--new-tokens", "4"],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
    )
    lines = dict(line.strip().split(": ", 1) for line in result.stdout.strip().splitlines())
    assert lines.keys() == {"dmattn_cute", "sdpa", "dynamic mask, top-8 keys per query"}
    for tokens in lines.values():
        assert [len(row) for row in ast.literal_eval(tokens)] == [4, 4]


@pytest.mark.gpu
@pytest.mark.parametrize(("make_model", "peer"), MODELS.values(), ids=MODELS.keys())
def test_logits_match_transformers_attention_on_cuda(make_model, peer) -> None:
    check_logits(make_model, peer, torch.bfloat16, "cuda")
