import time, torch
from dmattn_cute import flash_dmattn_func
from tests.utils import random_inputs
for S in (128, 4096):
    q, k, v, mask, bias = random_inputs(1, S, S, 8, 8, 64, torch.bfloat16, "cuda", mask_shape=(1, 8, S, S), bias_shape=(1, 8, 1, S), requires_grad=True)
    for _ in range(3): flash_dmattn_func(q, k, v, mask, bias).sum().backward()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50): out = flash_dmattn_func(q, k, v, mask, bias)
    t_f = (time.perf_counter() - t) / 50 * 1e3
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50): flash_dmattn_func(q, k, v, mask, bias).sum().backward()
    t_fb = (time.perf_counter() - t) / 50 * 1e3
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"S={S}: host ms per fwd call {t_f:.3f}, fwd+bwd {t_fb:.3f}")
