"""Forward against the float32 reference where every CTA, some CTAs or no CTA take the dense
walk (all key blocks FULL)."""
import torch
from dmattn_cute import flash_dmattn_func
from dmattn_cute.reference import attention_ref
from tests.utils import check_close, random_inputs

torch.manual_seed(1)
cases = []
def case(name, b, sq, sk, mask_fn, causal=False, block=False):
    q, k, v, _, bias = random_inputs(b, sq, sk, 8, 2, 128, torch.bfloat16, "cuda", bias_shape=(b, 2, 1, sk))
    mask = mask_fn(b, sq, sk)
    kw = {}
    if block:
        kw["block_mask"] = torch.ones(b, 2, -(-sq // 128), -(-sk // 128), dtype=torch.bool, device="cuda")
    with torch.no_grad():
        out = flash_dmattn_func(q, k, v, mask, bias, is_causal=causal, **kw)
        out2 = flash_dmattn_func(q, k, v, mask, bias, is_causal=causal, **kw)  # remembered bits
    ref, _ = attention_ref(q, k, v, mask, bias, is_causal=causal, compute_dtype=torch.float32)
    lowp, _ = attention_ref(q, k, v, mask, bias, is_causal=causal)
    try:
        check_close("out", out, ref, lowp, q.dtype); check_close("out2", out2, ref, lowp, q.dtype)
        print("PASS", name)
    except AssertionError as e:
        print("FAIL", name, str(e)[:200])
ones = lambda b, sq, sk: torch.ones(b, 2, sq, sk, dtype=torch.bool, device="cuda")
def mixed(b, sq, sk):
    m = ones(b, sq, sk); m[0, 1, 300, 77] = False; m[1, 0, 900:, 500] = False; return m
rand = lambda b, sq, sk: torch.rand(b, 2, sq, sk, device="cuda") < 0.5
case("all-true S1024", 2, 1024, 1024, ones)
case("all-true causal S1024", 2, 1024, 1024, ones, causal=True)
case("mixed S1024", 2, 1024, 1024, mixed)
case("random S1024", 2, 1024, 1024, rand)
case("all-true tail Sq1000 Sk1100", 2, 1000, 1100, ones)
case("all-true Sq384 Sk4096 (longer walk than 32 blocks)", 2, 384, 4224, ones)
case("block mask, no attn_mask", 2, 1024, 1024, lambda *a: None, block=True)
case("decode Sk8192 all-true", 2, 1, 8192, lambda b, sq, sk: torch.ones(b, 2, 1, sk, dtype=torch.bool, device="cuda"))
