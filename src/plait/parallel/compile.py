"""torch.compile applied to the model: regional compilation and float8 matmuls (the parallelisation plan's
step after activation checkpointing, before FSDP2); the caches and the recompilation guard around it are
plait.engine.compile_cache.

Regional compilation. Each TransformerBlock is wrapped by torch.compile on its own, with static shapes
(dynamic=False: the loader yields fixed (B, T) batches) and fullgraph=True (a graph break is an error, not a
silent slowdown). Every block runs the same code on the same shapes, so Dynamo traces one block, Inductor
compiles its forward and backward once, and all other blocks reuse that graph: compile time is one block's,
whatever the depth. The embedding, final norm, output projection and loss stay eager. In `parallelize` the
wrapping comes after activation checkpointing (the checkpointed block is traced whole) and before FSDP2, so
FSDP2's hooks sit outside the compiled region: its all-gathers and reduce-scatters are not traced and still
overlap with the compiled compute as in eager mode.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
from torch import nn

from plait.config import CompileConfig
from plait.core.errors import ConfigError

# ------------------------------------------------------------------------------------------ compilation


def apply_compile(model: nn.Module, c: CompileConfig, device: torch.device, fsdp: bool = False) -> nn.Module:
    """Compile each block of `model` (a Transformer or a pipeline stage of one) in place; float8 first where
    compile.float8 asks for it on this device (float8_plan), with float8 all-gathers when the blocks are then
    FSDP-sharded (`fsdp`). Nothing happens with compile.enabled=false."""
    if not c.enabled:
        return model
    _check_experts_compile(model, device)
    if float8_plan(c, device)[0]:
        apply_float8(model, c.float8, all_gather=fsdp, recipe=c.float8_recipe)
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict) and len(layers):
        for key, block in list(layers.items()):
            layers[key] = _compiled(block, c.mode)
    elif isinstance(layers, nn.ModuleList) and len(layers):
        for i, block in enumerate(list(layers)):
            layers[i] = _compiled(block, c.mode)
    else:  # a model without blocks (your own): compiled whole, in place
        model.compile(mode=c.mode, dynamic=False)
    return model


def _check_experts_compile(model: nn.Module, device: torch.device) -> None:
    """MoE blocks compile only where their experts run as grouped bf16 matmuls (the loop over experts reads
    each one's token count on the host: a graph break, which a compiled block refuses)."""
    from plait.core.torch_private import grouped_mm_runs
    from plait.model.moe import MoE

    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        dim, hidden = moe.router.in_features, moe.experts.w1.shape[1]
        if not grouped_mm_runs(device, torch.bfloat16, dim, hidden):
            where = "a CUDA GPU of compute capability 9.0 or newer (H100)"
            raise ConfigError(
                f"compile.enabled=true with a mixture-of-experts model needs grouped bf16 matmuls for its experts "
                f"(torch._grouped_mm), which run on {where} with model.dim and the expert width multiples of 8; "
                f"not on {device} with dim {dim}, width {hidden}, where each expert loops over its tokens (a graph "
                "break). Set compile.enabled=false"
            )


def _compiled(block: nn.Module, mode: str) -> nn.Module:
    """torch.compile of one block: static shapes, the whole block one graph (a graph break is an error)."""
    return cast(nn.Module, torch.compile(block, mode=mode, dynamic=False, fullgraph=True))


def float8_layers(choice: str, recipe: str = "tensorwise"):
    """module_filter_fn(module, fqn) of the linear layers float8 converts: those in the blocks (fqn 'layers.')
    whose sizes are multiples of 16 (a float8 GEMM requirement); with compile.float8=auto only those torchao's
    own heuristic for the recipe expects to gain (its H100 measurements: tensorwise scaling loses where
    K <= 4096 and N <= 1024; rowwise, with more work per matmul, needs larger ones). The output projection
    always stays in bf16 (the vocabulary matmul is the most sensitive to precision)."""
    from plait.core.torch_private import float8_auto_filter

    pays = float8_auto_filter(recipe) if choice == "auto" else None

    def eligible(module: nn.Module, fqn: str) -> bool:
        if not (isinstance(module, nn.Linear) and fqn.startswith("layers.")):
            return False
        if pays is not None:
            return pays(module, fqn)
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    return eligible


def apply_float8(model: nn.Module, choice: str = "true", all_gather: bool = False, recipe: str = "tensorwise") -> None:
    """Swap the blocks' linear layers (float8_layers) for torchao's Float8Linear with dynamic scaling by the
    recipe (compile.float8_recipe): tensorwise, matmuls in float8 e4m3 forward / e5m2 gradients; rowwise, every
    operand e4m3 with a power-of-2 scale per row. Master weights and everything else unchanged.
    all_gather (tensorwise only; rowwise gathers in bf16): FSDP2 all-gathers those weights in float8 (half the
    bytes of bf16); each weight's scale then comes from the amax of the whole weight, one all-reduce per weight
    in its pre-all-gather (torchao's precompute_float8_dynamic_scale_for_fsdp, one all-reduce for all, would
    have to run after every change to the weights, checkpoint loads and rollbacks included, or the next
    all-gather casts with a stale scale)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError(f"compile.float8 needs torchao: {TORCHAO_INSTALL}") from None
    config = Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=all_gather)
    convert_to_float8_training(model, config=config, module_filter_fn=float8_layers(choice, recipe))


# torchao releases follow torch's: 0.17 is the one built against torch 2.11, 0.18 against 2.12 and later.
TORCHAO_INSTALL = "pip install 'torchao==0.17.*'" if torch.__version__ < "2.12" else "pip install 'torchao>=0.18'"


def _float8_problems(device: torch.device) -> list[str]:
    import importlib.util

    problems = []
    if importlib.util.find_spec("torchao") is None:
        problems.append(f"torchao is not installed ({TORCHAO_INSTALL})")
    if device.type != "cuda":
        problems.append(f"this run is on {device.type}, not an NVIDIA GPU")
    elif torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        problems.append(f"{torch.cuda.get_device_name(device)} is sm{major}{minor}")
    return problems


def check_float8_support(device: torch.device) -> None:
    """Refuse float8 before anything is built where it cannot run, naming every reason at once."""
    problems = _float8_problems(device)
    if problems:
        raise ConfigError(
            f"compile.float8=true cannot run here: {'; '.join(problems)}. Float8 training needs torchao and an "
            f"NVIDIA GPU of compute capability 8.9+ (H100, H200, L4, L40S); set compile.float8=false or auto"
        )


def float8_plan(c: CompileConfig, device: torch.device, block: nn.Module | None = None) -> tuple[bool, str]:
    """Whether the blocks' matmuls run in float8 on this device, and why. compile.float8=true: yes, refused
    (ConfigError) where it cannot run; auto: where compile is on, torchao is installed and the device is an
    NVIDIA GPU of compute capability 8.9+, and (given one of the model's blocks, built on meta) where some of
    its linear layers pass float8_layers('auto')."""
    choice = c.float8
    if choice == "false" or not c.enabled:
        return False, "compile.float8=false" if choice == "false" else "compile.enabled=false"
    if choice == "true":
        check_float8_support(device)
        return True, f"compile.float8=true, {c.float8_recipe}"
    problems = _float8_problems(device)
    if problems:
        return False, "; ".join(problems)
    import torchao

    why = f"{torch.cuda.get_device_name(device)}, torchao {torchao.__version__}, {c.float8_recipe}"
    if block is not None:
        keep = float8_layers("auto", c.float8_recipe)
        names = [name for name, m in block.named_modules() if keep(m, f"layers.0.{name}")]
        if not names:
            return False, f"no block layer is large enough to gain by torchao's {c.float8_recipe} heuristic"
        why += f"; per block: {', '.join(names)}"
    return True, why
