"""Mesh strings, mesh construction and the 2d default split."""

import jax
import pytest

import shardplug
import shardplug.errors
from shardplug import DeviceError, MeshError, get_strategy, parse_mesh, select_devices
from shardplug.core.compose import default_sizes
from shardplug.core.mesh import build_mesh, describe


def test_parse_mesh():
    assert parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    assert parse_mesh(" data = 8 ") == {"data": 8}


@pytest.mark.parametrize("text", ["data", "data=0", "data=-2", "data=x", "=4", "data=2,,", "2=2"])
def test_malformed_mesh_strings(text):
    with pytest.raises(MeshError, match="malformed mesh"):
        parse_mesh(text)


def test_repeated_axis():
    with pytest.raises(MeshError, match="appears twice"):
        parse_mesh("data=2,data=4")


def test_mesh_that_does_not_match_the_devices():
    with pytest.raises(MeshError, match="has 6 devices but the run has 8"):
        get_strategy("2d").make_mesh(jax.devices(), {"data": 2, "model": 3})


def test_mesh_with_axes_the_strategy_lacks():
    with pytest.raises(MeshError, match=r"give sizes for exactly \['data'\]"):
        get_strategy("pmap").make_mesh(jax.devices(), {"model": 8})
    with pytest.raises(MeshError, match="mesh axis 'tp' is not an axis of this composition"):
        get_strategy("2d").make_mesh(jax.devices(), {"data": 4, "tp": 2})


def test_a_composition_sizes_the_axes_left_out():
    assert describe(get_strategy("2d").make_mesh(jax.devices(), {"data": 8})) == "data=8,model=1"
    mesh = get_strategy("dp+fsdp+tp").make_mesh(jax.devices(), {"model": 4})
    assert describe(mesh) == "data=2,fsdp=1,model=4"


def test_build_mesh_keeps_the_default_axis_order():
    mesh = build_mesh(jax.devices(), {"model": 4, "data": 2}, default={"data": 1, "model": 1})
    assert mesh.axis_names == ("data", "model")
    assert describe(mesh) == "data=2,model=4"


@pytest.mark.parametrize(
    ("count", "split"),
    [(1, (1, 1)), (2, (2, 1)), (4, (2, 2)), (6, (3, 2)), (8, (4, 2)), (16, (4, 4)), (7, (7, 1))],
)
def test_default_split_of_two_axes(count, split):
    assert tuple(default_sizes(count, 2)) == split


@pytest.mark.parametrize(("count", "split"), [(8, (2, 2, 2)), (16, (4, 2, 2)), (4, (2, 2, 1))])
def test_default_split_of_three_axes(count, split):
    assert tuple(default_sizes(count, 3)) == split


def test_select_devices():
    assert len(select_devices(3)) == 3
    assert len(select_devices()) == 8
    with pytest.raises(DeviceError, match=r"asked for 9 devices but this machine has 8 CPU dev"):
        select_devices(9)
    with pytest.raises(DeviceError):
        select_devices(0)


class FakeDevice:
    def __init__(self, platform, kind):
        self.platform, self.device_kind = platform, kind


def test_every_accelerator_by_default_and_one_line_for_too_many():
    """The one decision, with the backend's devices injected: all of an accelerator's by
    default, the first N when asked, and a count above them names what exists."""
    gpu = [FakeDevice("gpu", "NVIDIA H100 80GB HBM3")]
    assert select_devices(None, devices=gpu) == gpu
    assert select_devices(1, devices=gpu) == gpu
    with pytest.raises(DeviceError) as error:
        select_devices(4, devices=gpu)
    assert str(error.value) == (
        "asked for 4 devices but this machine has 1 GPU device (NVIDIA H100 80GB HBM3): ask "
        "for at most 1, or leave --devices out to use them all"
    )
    eight = [FakeDevice("gpu", "NVIDIA H200")] * 8
    assert len(select_devices(None, devices=eight)) == 8


def test_a_gpu_that_jax_cannot_see_is_said_once(monkeypatch):
    from shardplug.core import devices

    cpu = [FakeDevice("cpu", "cpu")]
    monkeypatch.setattr(devices, "nvidia_gpu_visible", lambda: False)
    assert select_devices(None, devices=cpu) == cpu  # no GPU, nothing to say
    monkeypatch.setattr(devices, "nvidia_gpu_visible", lambda: True)
    monkeypatch.setattr(shardplug.errors, "_SAID", set())  # said afresh
    with pytest.warns(shardplug.ShardplugWarning, match=r"JAX has only its CPU backend.*\[cuda"):
        select_devices(None, devices=cpu)
    select_devices(None, devices=cpu)  # said once: a second warning would fail the suite
