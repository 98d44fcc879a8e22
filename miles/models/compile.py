"""`--compile`: `torch.compile` of a family's transformer blocks in place (one compiled code shared by identical
blocks, names and state-dict keys unchanged) or of its whole forward, the same in the trainer ranks and the engines;
and the process's compile counters (seconds, recompiles) the metrics report."""

from __future__ import annotations

import logging
import os

import torch
import torch._dynamo
import torch._dynamo.utils
import torch._inductor.config
import torch.fx.experimental._config
from torch import nn

from miles.models.base import TrainPipelineConfig

logger = logging.getLogger(__name__)

COMPILE_MODES = ("off", "blocks", "full")
# Graphs one block's code may hold: its variants (SD3's last block skips the context branch), grad and no-grad
# forwards, batch 1 (specialised even with dynamic shapes) and others, adapters on and off (the LoRA `ref`). torch's
# default of 8 would silently fall back to eager past it.
RECOMPILE_LIMIT = 64
# torch.compile's backend: inductor generates fused kernels; `aot_eager` traces the same graphs (guards, recompiles,
# autograd) and runs them with eager kernels, with no code generation: for checking how compilation composes with a
# setup without paying inductor's minutes on a CPU (the fast tests use it)
BACKEND_ENV = "MILES_COMPILE_BACKEND"
# dynamo's own timer around each frame it compiles (tracing, AOT autograd, inductor's code generation)
_COMPILE_TIMER = "_compile.compile_inner"


def _check_mode(mode: str) -> None:
    if mode not in COMPILE_MODES:
        raise ValueError(f"--compile {mode!r} is not one of {', '.join(COMPILE_MODES)}")


def check_compile(family: TrainPipelineConfig, mode: str) -> None:
    """Raise ValueError naming the flag when `mode` is unknown or the family refuses compilation (its declared
    `compile_refusal`)."""
    _check_mode(mode)
    if mode != "off" and family.compile_refusal is not None:
        raise ValueError(
            f"--compile {mode}: the {family.name} family cannot be compiled ({family.compile_refusal}); use --compile off"
        )


def compile_transformer(transformer: nn.Module, blocks: list[nn.Module], mode: str) -> None:
    """Compile `transformer` in place: `blocks` compiles each of `blocks` (the family's `transformer_blocks`)
    (`nn.Module.compile`, as diffusers' `compile_repeated_blocks`: identical blocks share one code object and so one
    compiled graph, and compile time does not grow with depth), `full` the whole forward; `off` does nothing.

    In place, so parameter names, state-dict keys, LoRA keys and weight exports are those of the eager module (no
    `_orig_mod.`), and `load_state_dict` / `copy_` into the parameters reuse the compiled code. Shapes are dynamic
    from the first call (`dynamic=True`): micro-batches, CFG's doubled batch and eval batches share one graph; a batch
    of 1 gets its own (torch specialises sizes 0 and 1). Call it after LoRA injection and activation checkpointing and
    before `fully_shard` (torchtitan's order). The backend is inductor unless $MILES_COMPILE_BACKEND names another."""
    _check_mode(mode)
    if mode == "off":
        return
    watch_recompiles()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    # without duck shaping a batch of 2 gets its own symbol instead of sharing one with another size-2 dimension
    # (Wan's, LTX-2's), which made the next batch size recompile every block's graph
    torch.fx.experimental._config.use_duck_shape = False
    # inductor's CPU kernels otherwise specialise on the process's torch thread count at their compile: a kernel
    # compiled under 1 thread is serial for good (no OpenMP region at all). miles changes a process's count between
    # phases (`--cpu-phase-threads auto`: an engine generates with the node's cores, its base count is its Ray
    # share), so the kernels read the count at each call instead, as the ATen kernels around them do
    torch._inductor.config.cpp.dynamic_threads = True
    name, backend = type(transformer).__name__, os.environ.get(BACKEND_ENV, "inductor")
    if mode == "blocks":
        for block in blocks:
            block.compile(dynamic=True, backend=backend)
        logger.info("compiled %d blocks of the %s in place (regional compilation)", len(blocks), name)
    else:
        transformer.compile(dynamic=True, backend=backend)
        logger.info("compiled the whole %s forward", name)


_recompiles = 0
_watching = False


def _count_recompile() -> str:
    global _recompiles
    _recompiles += 1
    return "miles: counted in perf/compile_recompiles"


def watch_recompiles() -> None:
    """Count this process's recompilations (dynamo calls the hook when a compiled frame's guards fail and it compiles
    that frame again); idempotent."""
    global _watching
    if not _watching:
        torch._dynamo.utils.register_hook_for_recompile_user_context(_count_recompile)
        _watching = True


def compile_counters() -> dict[str, float]:
    """This process's totals so far: `compile_s`, the seconds dynamo spent compiling frames (first compiles and
    recompiles, inductor included; a cache hit costs little), and `compile_recompiles`, the compiles of a frame that
    already had compiled code whose guards failed (a new shape, grad mode or block variant)."""
    seconds = sum(torch._dynamo.utils.compilation_time_metrics.get(_COMPILE_TIMER, ()))
    return {"compile_s": float(seconds), "compile_recompiles": float(_recompiles)}
