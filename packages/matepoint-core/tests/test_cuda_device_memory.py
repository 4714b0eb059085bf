"""``CudaMemory`` against the real caching allocator (Note [The budget guard], rule 6).

One segment is split into pieces and every other piece freed: those are free pieces of a
segment in use, which the allocator can neither give a larger request nor give back. Under a
cap that leaves no room for a new segment, a larger request then runs out of memory, and
``CudaMemory`` reads the pieces, the limit reached and the pieces held at the error.
"""

from __future__ import annotations

import pytest
import torch

from matepoint._device_memory import AllocatorMemory, CudaMemory

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_start")]

MIB = 1 << 20
KEPT, FREED = 48 * MIB, 16 * MIB
PAIRS = 8


def _bytes(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, device="cuda")


def test_cuda_memory_reads_the_free_pieces_and_the_limit_at_an_error() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    memory = CudaMemory(torch.device("cuda"))
    assert isinstance(memory, AllocatorMemory)
    # One segment of PAIRS * (KEPT + FREED) bytes, cached, then split by the pairs.
    segment = _bytes(PAIRS * (KEPT + FREED))
    del segment
    total = torch.cuda.get_device_properties(0).total_memory
    # Room for what is held now and a little more, not for a segment of 2 * FREED.
    cap = torch.cuda.memory_reserved() + 4 * MIB
    torch.cuda.set_per_process_memory_fraction(cap / total)
    memory.reset_peak()
    assert not memory.reached_limit()
    kept, freed = [], []
    for _ in range(PAIRS):
        kept.append(_bytes(KEPT))
        freed.append(_bytes(FREED))
    del freed
    assert memory.pieces_peak_bytes() >= PAIRS * FREED
    assert memory.unallocated_bytes() >= PAIRS * FREED
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _bytes(2 * FREED)
    assert memory.reached_limit()
    # At the error the allocator had given back every free segment: what it holds beyond the
    # allocated bytes is the pieces (and the small pool's, of a few small live tensors).
    assert PAIRS * FREED <= memory.unallocated_bytes() < PAIRS * FREED + 32 * MIB
    assert memory.reserved_peak_bytes() >= PAIRS * (KEPT + FREED)
    assert memory.peak_bytes() >= PAIRS * (KEPT + FREED)
    del kept
    memory.reset_peak()
    assert not memory.reached_limit()
