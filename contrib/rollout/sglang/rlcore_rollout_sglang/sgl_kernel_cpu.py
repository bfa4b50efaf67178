"""Import-only stand-in for ``sgl_kernel``, SGLang's CPU kernel package, imported under that name by
``rlcore_rollout_sglang.cpu`` where no real one is installed (see ``sgl_kernel_stand_in`` there for why).

SGLang 0.5.23's CPU engine imports the names below at module import. On a CPU without AMX, plain generation calls
only ``assign_req_to_token_pool_cpu`` (writing a batch's KV-cache slots into the request-to-token table), which is
implemented here in torch; every other function raises ``NotImplementedError`` naming itself (they serve speculative
decoding and KV-cache moves, which this backend does not use). Nothing here is ever silently wrong.
"""
from __future__ import annotations

import torch

__version__ = "0.0.0+rlcore.cpu.stand.in"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int | None = None) -> None:
    """``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` takes the next ``end - start`` entries of
    ``out_cache_loc``, request by request (the semantics of SGLang's kernel of this name)."""
    offset = 0
    for i in range(req_pool_indices.numel()):
        start, end = int(start_offset[i]), int(end_offset[i])
        req_to_token[int(req_pool_indices[i]), start:end] = out_cache_loc[offset:offset + end - start].to(
            req_to_token.dtype)
        offset += end - start


def _not_implemented(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available: rlcore runs SGLang on CPU with an import-only "
                                  f"stand-in for its CPU kernel package (no PyPI build exists); this path (speculative "
                                  f"decoding or KV-cache moves) is not supported there")
    kernel.__name__ = kernel.__qualname__ = name
    return kernel


NOT_IMPLEMENTED = ("copy_all_layer_kv_cache_cpu", "assign_draft_cache_locs_contiguous_cpu",
                   "assign_extend_cache_locs_cpu", "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu",
                   "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu", "rotate_input_ids_cpu")
for _name in NOT_IMPLEMENTED:
    globals()[_name] = _not_implemented(_name)
