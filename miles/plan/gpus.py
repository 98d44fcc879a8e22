"""The GPUs a plan is made for (`--plan-gpu`): their memory as `nvidia-smi` reports it, and the reserve a plan keeps
free on each for what the simulation does not see (the CUDA context, NCCL's buffers, the caching allocator's
fragmentation)."""

from __future__ import annotations

from dataclasses import dataclass

from miles.arguments.plan import plan_gpu_memory

MIB, GIB = 2**20, 2**30
CONTEXT_RESERVE_BYTES = int(1.5 * GIB)  # the CUDA context and kernels (~0.5-1 GiB) and NCCL's channel buffers
FRAGMENTATION_RESERVE = 0.05  # of the total: the caching allocator's blocks that cannot be reused


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int

    @property
    def reserve_bytes(self) -> int:
        return CONTEXT_RESERVE_BYTES + int(FRAGMENTATION_RESERVE * self.memory_bytes)

    @property
    def usable_bytes(self) -> int:
        """What the run's tensors may hold at their peak."""
        return self.memory_bytes - self.reserve_bytes


def gpu_spec(value: str) -> GpuSpec:
    """`--plan-gpu`: a known name (`h100-80gb`, ...; `GPU_MEMORY_MIB`) or a size in GiB (`80`, `24.5`)."""
    name, memory_bytes = plan_gpu_memory(value)
    return GpuSpec(name, memory_bytes)
