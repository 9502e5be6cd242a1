"""Flash Dynamic Mask Attention in the CuTe Python DSL, exposed as PyTorch ops."""

from dmattn_cute.attention import flash_dmattn_func
from dmattn_cute.block_mask import create_block_mask
from dmattn_cute.kvcache import flash_dmattn_with_kvcache
from dmattn_cute.masks import create_mask
from dmattn_cute.varlen import flash_dmattn_varlen_func

__all__ = [
    "create_block_mask",
    "create_mask",
    "flash_dmattn_func",
    "flash_dmattn_varlen_func",
    "flash_dmattn_with_kvcache",
]
