"""Every parameter and buffer on its device. On the CPU the compute device and CPU offload's device are one, so a
buffer left on the CPU is invisible there (llama3-8b with offload crashed at its first forward on a GPU: the
rotary tables stayed on the CPU). These tests let the meta device stand in for the accelerator: allocation
must put the buffers there and the parameters on the CPU, and the check must name what is elsewhere."""

import pytest
import torch
from torch import nn

from plait.config import load_config
from plait.core.errors import PlaitError
from plait.model import Transformer, preset_args
from plait.parallel.materialize import materialize
from plait.parallel.placement import allocate, check_placement, misplaced

ACCELERATOR = torch.device("meta")  # a second device a CPU test can tell from the CPU


def _on_meta(preset: str) -> Transformer:
    with torch.device("meta"):
        return Transformer(preset_args(preset))


@pytest.mark.parametrize("preset", ["debug", "moe-debug"])
def test_offload_allocates_parameters_on_the_cpu_and_buffers_on_the_compute_device(preset):
    model = _on_meta(preset)
    materialize(model, ACCELERATOR, seed=0, cpu_offload=True)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    buffers = dict(model.named_buffers())
    assert {"rope_cos", "rope_sin"} <= buffers.keys()
    if preset == "moe-debug":
        assert any(name.endswith("expert_bias") for name in buffers)  # the routing state too
    assert {b.device.type for b in buffers.values()} == {"meta"}
    assert misplaced(model, ACCELERATOR, cpu_offload=True) == []
    # the persistent buffers stay persistent (checkpointed), the rotary tables stay out of the state dict
    state = model.state_dict()
    assert "rope_cos" not in state and any(k.endswith("expert_bias") for k in state) == (preset == "moe-debug")


def test_the_check_names_a_buffer_left_on_the_cpu():
    """What plait did before: every tensor allocated on the CPU under offload. The check fails, naming them."""
    model = _on_meta("moe-debug")
    model.to_empty(device="cpu")
    with pytest.raises(PlaitError, match=r"tensors on the wrong device: buffer rope_cos: on cpu, not meta; .*more"):
        check_placement(model, ACCELERATOR, cpu_offload=True)


def test_the_check_names_a_parameter_off_the_device():
    model = _on_meta("debug")
    allocate(model, torch.device("cpu"))
    check_placement(model, torch.device("cpu"))
    model.norm.weight = nn.Parameter(torch.ones(model.norm.weight.shape, device="meta"))
    assert misplaced(model, torch.device("cpu")) == ["parameter norm.weight: on meta, not cpu"]
    with pytest.raises(PlaitError, match="parameter norm.weight: on meta, not cpu"):
        check_placement(model, torch.device("cpu"))


class _StrayBuffer(nn.Module):
    """A model of your own whose init_weights() creates its buffer on another device."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8))

    def init_weights(self):
        self.proj.reset_parameters()
        self.scale = torch.ones(8, device="meta")

    def forward(self, x):
        return self.proj(x) * self.scale


def test_the_runtime_refuses_a_misplaced_tensor_before_the_first_step():
    from plait.engine.trainable import build_trainable

    cfg = load_config(None, ["run.device=cpu", "train.fused_head=false"])
    with pytest.raises(PlaitError, match=r"buffer scale: on meta, not cpu.*init_weights\(\)"):
        build_trainable(cfg, torch.device("cpu"), model=_StrayBuffer, loss=lambda out, y: out.mean())


def test_saved_activations_name_a_tensor_off_the_device_but_not_a_host_scalar():
    """plait fit's check of what the forward saves: a tensor on another device is named with its shape; a CPU
    tensor of at most two elements (a host scalar, such as the RNG seed flash attention returns beside its
    output, or an empty placeholder, which the same kernels save under checkpointing) is not flagged."""
    from plait.parallel.activations import SavedBytes

    w = torch.randn(4, 4, device="meta", requires_grad=True)
    with SavedBytes() as scalars_only:
        (w * torch.tensor(2.0)).sum()  # saves the CPU scalar for w's gradient
        for n in (0, 2):  # an empty placeholder and a seed-and-offset pair
            (torch.ones(n, requires_grad=True) * torch.ones(n)).sum()
        (w @ w).sum()
    assert scalars_only.devices == {torch.device("meta")}
    z = torch.randn(2, 3, requires_grad=True)
    with SavedBytes() as misplaced:
        (w @ w).sum()
        (z * z).sum()
    assert misplaced.devices == {torch.device("meta"), torch.device("cpu")}
    assert misplaced.placed[torch.device("cpu")] == "(2, 3) float32"
