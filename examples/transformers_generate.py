"""Generate with a transformers model whose attention runs on dmattn_cute.

A tiny randomly initialised Llama (GQA: 4 query heads, 2 kv heads), greedy decoding with the
kv cache, a left-padded batch:
1. the stock model with attn_implementation="dmattn_cute", against "sdpa" on the same weights
   (in bf16, where two tokens are nearly tied, either's rounding may pick the other);
2. the same model with dynamic mask attention layers (same projections): each key gets a
   per-kv-head bias computed from its value (`exp(a) * softplus(W v)`, as flash-dmattn's Doge
   models do), and each query attends to its `keep` keys of largest bias. The layer passes the
   bias and `keep` to the attention function as `attention_bias` and `keep_window_size`.

    python examples/transformers_generate.py [--device cpu|cuda] [--new-tokens N]

On a CPU the attention runs the PyTorch reference; on a GPU the CuTe kernels.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb

from dmattn_cute.integrations.transformers import attention_forward, register


class DynamicMaskLlamaAttention(LlamaAttention):
    """LlamaAttention plus a learned per-key bias and a top-`keep` key mask per query."""

    def __init__(self, config: LlamaConfig, layer_idx: int, keep: int) -> None:
        super().__init__(config, layer_idx)
        heads_kv = config.num_key_value_heads
        self.keep = keep
        self.bias_proj = nn.Linear(heads_kv * self.head_dim, heads_kv)
        self.bias_log_scale = nn.Parameter(torch.zeros(heads_kv))

    def forward(
        self,
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor],
        attention_mask: Tensor | None = None,
        past_key_values=None,
        **kwargs,
    ) -> tuple[Tensor, None]:
        batch, seqlen, _ = hidden_states.shape
        split = (batch, seqlen, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(split).transpose(1, 2)  # [B, H, S, D]
        k = self.k_proj(hidden_states).view(split).transpose(1, 2)  # [B, Hkv, S, D]
        v = self.v_proj(hidden_states).view(split).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        if past_key_values is not None:  # k, v: every key so far, [B, Hkv, Sk, D]
            k, v = past_key_values.update(k, v, self.layer_idx)
        # One bias per (kv head, key) from the key's value: [B, Sk, Hkv] -> [B, Hkv, Sk].
        v_flat = v.transpose(1, 2).flatten(2)
        bias = self.bias_log_scale.exp() * F.softplus(self.bias_proj(v_flat))
        out, _ = attention_forward(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0,
            scaling=self.scaling,
            attention_bias=bias.transpose(1, 2),
            keep_window_size=self.keep,
        )
        return self.o_proj(out.reshape(batch, seqlen, -1)), None


def tiny_llama(device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    register()  # adds attn_implementation="dmattn_cute"

    model = tiny_llama(args.device, torch.bfloat16)
    prompts = torch.randint(1, 256, (2, 24), device=args.device)
    attention_mask = torch.ones_like(prompts)
    attention_mask[1, :9] = 0  # the second prompt is 9 tokens shorter, padded on the left
    generate = {
        "input_ids": prompts,
        "attention_mask": attention_mask,
        "max_new_tokens": args.new_tokens,
        "do_sample": False,
    }
    for implementation in ("dmattn_cute", "sdpa"):
        model.set_attn_implementation(implementation)
        tokens = model.generate(**generate)[:, prompts.shape[1] :]
        print(f"{implementation:>11}: {tokens.tolist()}")

    model.set_attn_implementation("dmattn_cute")
    for index, layer in enumerate(model.model.layers):
        attention = DynamicMaskLlamaAttention(model.config, index, keep=8)
        attention.load_state_dict(layer.self_attn.state_dict(), strict=False)  # same q/k/v/o
        layer.self_attn = attention.to(device=args.device, dtype=torch.bfloat16)
    tokens = model.generate(**generate)[:, prompts.shape[1] :]
    print(f"dynamic mask, top-8 keys per query: {tokens.tolist()}")


if __name__ == "__main__":
    main()
