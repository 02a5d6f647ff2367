"""Copies of an operand into another layout: the transposing copies TF32 needs.

Hopper's wgmma reads TF32 operands from shared memory only K-major, so a row-major B is
copied K-major first (plan.OperandCopy.COLUMNS). torch's copy_ of a transposed view reads
or writes with a stride on one side and is slow for it (benchmarks/NOTES.md step 11); this
kernel moves square tiles, each read and written along its contiguous dimension (Triton
stages the tile through shared memory between the two).
"""

import torch
import triton
import triton.language as tl

BLOCK = 64  # a 64x64 fp32 tile: 16 KB through shared memory


@triton.jit
def relayout_kernel(src, dst, rows, cols,
                     src_stride_batch, src_stride_row, src_stride_col,
                     dst_stride_batch, dst_stride_row, dst_stride_col,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """dst[b] = src[b] for (batches, rows, cols) views; one program per tile, all batches
    in one flat grid (no grid-dimension limits)."""
    tiles_r = tl.cdiv(rows, BLOCK_R)
    tiles_c = tl.cdiv(cols, BLOCK_C)
    pid = tl.program_id(0)
    batch = (pid // (tiles_r * tiles_c)).to(tl.int64)
    tile = pid % (tiles_r * tiles_c)
    offs_r = ((tile // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_c = ((tile % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    mask = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
    x = tl.load(src + batch * src_stride_batch + offs_r[:, None] * src_stride_row
                + offs_c[None, :] * src_stride_col, mask=mask)
    tl.store(dst + batch * dst_stride_batch + offs_r[:, None] * dst_stride_row
             + offs_c[None, :] * dst_stride_col, x, mask=mask)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst.copy_(src) for (R, C) or (B, R, C) views of one dtype; a transposing copy (each side
    contiguous along a different dimension) on a GPU goes through the tiled kernel."""
    transposing = dst.stride(-1) == 1 and src.stride(-2) == 1 and src.stride(-1) != 1
    if dst.is_cuda and transposing:
        with torch.cuda._DeviceGuard(dst.device.index):  # Triton launches on the current device
            launch(relayout_kernel, dst, src)
    else:
        dst.copy_(src)
    return dst


def launch(kernel, dst: torch.Tensor, src: torch.Tensor) -> None:
    """`kernel` is relayout_kernel, or an interpreted copy of it for CPU tensors (tests)."""
    if dst.shape != src.shape or dst.dtype != src.dtype or dst.dim() not in (2, 3):
        raise ValueError(f"relayout needs (R, C) or (B, R, C) views of one shape and dtype, got "
                         f"{tuple(dst.shape)} {dst.dtype} and {tuple(src.shape)} {src.dtype}")
    if dst.dim() == 2:
        dst, src = dst.unsqueeze(0), src.unsqueeze(0)
    batches, rows, cols = src.shape
    if src.numel() == 0:
        return
    grid = (batches * triton.cdiv(rows, BLOCK) * triton.cdiv(cols, BLOCK),)
    kernel[grid](src, dst, rows, cols, *src.stride(), *dst.stride(), BLOCK_R=BLOCK, BLOCK_C=BLOCK)
