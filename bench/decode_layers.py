"""A model's decode step against HBM bandwidth: `layers` attention layers, each with its own
kv cache, per-key bias and block mask (the bench's decode rows: B8 H16 Hkv4 D128 bf16, 64-key
blocks at density 0.25), called through the kv-cache API and captured into one CUDA graph, as
serving loops capture a whole step. A layer's time is a replay's over `layers`: no graph
launch per layer, and every layer finds L2 holding the layers before it, not its own cache
(the inputs rotate, METHOD.md), without a flush kernel between them.

    python3 -m bench.decode_layers [--seqlens 32768 131072] [--layers 8] [--out DIR]

Reports, per cache length, the median ms of a replay (bench.run.events_median) and of one
layer, the K/V bytes of the key tiles each layer runs (those with a visible key), and that
traffic's rate against the device's measured copy ceiling (bytes read plus written by a
device-to-device copy of 1 and 2 GiB, the larger) and its datasheet bandwidth (issue 16's
decode target).
"""

from __future__ import annotations

import argparse
import functools

import torch

from bench.run import events_median, executed_fraction, write_result
from bench.workloads import Inputs, Workload, block_mask, make_inputs
from dmattn_cute import flash_dmattn_with_kvcache

DATASHEET_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}


def workload(seqlen_k: int) -> Workload:
    """The bench's decode row at this cache length (bench.workloads.decode_suite)."""
    return Workload("decode", 8, 1, seqlen_k, 128, bias="key", mask="blocks", density=0.25)


def visible_kv_bytes(w: Workload, x: Inputs) -> int:
    """K and V bytes of the key tiles the forward runs (bench.run.executed_fraction: the tiles
    with a visible key, tails to Sk), over every batch row and kv head."""
    return round(executed_fraction(w, x, "fwd") * 2 * x.k.numel() * x.k.element_size())


def copy_ceiling() -> float:
    """Bytes per second of the device's largest device-to-device copy (1 or 2 GiB), counting
    the bytes read and the bytes written."""
    best = 0.0
    for gib in (1, 2):
        src = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
        ms = events_median(functools.partial(torch.empty_like(src).copy_, src))
        best = max(best, 2 * src.numel() / (ms * 1e-3))
    return best


def step_graph(layers: list[Inputs]):
    """A replay function of one decode step over `layers` captured into a CUDA graph (after a
    warm-up call that compiles and plans)."""

    def step():
        return [
            flash_dmattn_with_kvcache(x.q, x.k, x.v, attn_mask=x.mask, attn_bias=x.bias)
            for x in layers
        ]

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", help="directory for decode_layers.json")
    args = parser.parse_args()
    name = torch.cuda.get_device_name()
    datasheet = next((v for k, v in DATASHEET_BYTES_PER_S.items() if k in name), None)
    ceiling = copy_ceiling()
    result = {
        "device": name,
        "layers": args.layers,
        "copy_ceiling_tb_s": ceiling / 1e12,
        "rows": [],
    }
    for seqlen_k in args.seqlens:
        w = workload(seqlen_k)
        layers = [make_inputs(w, "cuda") for _ in range(args.layers)]  # (seeded alike)
        for seed, x in enumerate(layers):  # each layer's own visible blocks
            torch.manual_seed(seed)
            x.mask.copy_(block_mask(w, "cuda"))
        ms = events_median(step_graph(layers))
        layer_ms = ms / args.layers
        visible = sum(visible_kv_bytes(w, x) for x in layers) / args.layers
        rate = visible / (layer_ms * 1e-3)
        row = {
            "workload": w.name,
            "step_ms": ms,
            "layer_ms": layer_ms,
            "visible_kv_mb": visible / 1e6,
            "tb_s": rate / 1e12,
            "of_copy_ceiling": rate / ceiling,
            "of_datasheet": None if datasheet is None else rate / datasheet,
        }
        result["rows"].append(row)
        print(
            f"Sk {seqlen_k}: step {ms:.4f} ms, layer {layer_ms:.4f} ms, {rate / 1e12:.3f} TB/s "
            f"= {rate / ceiling:.1%} of the copy ceiling {ceiling / 1e12:.3f} TB/s"
            + ("" if datasheet is None else f", {rate / datasheet:.1%} of the datasheet"),
            flush=True,
        )
        del layers
    write_result(result, args.out, "decode_layers.json")


if __name__ == "__main__":
    main()
