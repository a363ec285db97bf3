"""connector.triton_launch.DirectLauncher's bookkeeping: which launches reuse a kept kernel and
which go through Triton's own launch again (a stand-in for the jit function records the calls;
the GPU test in tests/test_triton_inject.py runs real kernels both ways)."""

from __future__ import annotations

import types

import pytest
import torch

from connector.triton_launch import DirectLauncher


class RecordingJit:
    """What DirectLauncher reads of a @triton.jit function, and what a launch returns."""

    arg_names = ["src", "n", "stride", "BLOCK"]
    params = [types.SimpleNamespace(name=n, is_constexpr=n == "BLOCK") for n in arg_names]

    def __init__(self) -> None:
        self.compiles: list[tuple] = []
        self.direct: list[tuple] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.compiles.append((grid, args, kwargs))
            jit = self

            class Compiled:
                def __getitem__(self, grid2):
                    return lambda *a, stream=None: jit.direct.append((grid2, a, stream))

            return Compiled()

        return launch


@pytest.fixture()
def launcher(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("KVMEM_TRITON_DIRECT_LAUNCH", raising=False)
    return DirectLauncher(RecordingJit(), do_not_specialize=("n",))


def test_the_second_launch_of_a_specialisation_goes_direct_with_the_constexprs_appended(launcher) -> None:
    x = torch.zeros(8, dtype=torch.int64)
    launcher((1, 1, 1), (x, 5, 16), {"BLOCK": 4}, num_warps=4)
    launcher((2, 1, 1), (x, 7, 16), {"BLOCK": 4}, num_warps=4)  # n is not specialised
    assert len(launcher.fn.compiles) == 1
    assert launcher.fn.direct == [((2, 1, 1), (x, 7, 16, 4), None)]


@pytest.mark.parametrize(
    "second",
    [
        lambda x: ((x[1:], 5, 16), {"BLOCK": 4}, {"num_warps": 4}),  # 8-byte offset: not 16-byte aligned
        lambda x: ((x.to(torch.int32), 5, 16), {"BLOCK": 4}, {"num_warps": 4}),  # another dtype
        lambda x: ((x, 5, 17), {"BLOCK": 4}, {"num_warps": 4}),  # a specialised int changed
        lambda x: ((x, 2**31, 16), {"BLOCK": 4}, {"num_warps": 4}),  # an unspecialised int needs 64 bits
        lambda x: ((x, 5, 16), {"BLOCK": 8}, {"num_warps": 4}),  # another constexpr
        lambda x: ((x, 5, 16), {"BLOCK": 4}, {"num_warps": 8}),  # another launch option
    ],
    ids=["misaligned", "dtype", "specialised-int", "int64", "constexpr", "option"],
)
def test_any_change_triton_specialises_on_goes_through_tritons_launch(launcher, second) -> None:
    x = torch.zeros(8, dtype=torch.int64)
    launcher((1, 1, 1), (x, 5, 16), {"BLOCK": 4}, num_warps=4)
    args, constexprs, options = second(x)
    launcher((1, 1, 1), args, constexprs, **options)
    assert len(launcher.fn.compiles) == 2 and not launcher.fn.direct


def test_switched_off_every_launch_is_tritons(monkeypatch) -> None:
    monkeypatch.setenv("KVMEM_TRITON_DIRECT_LAUNCH", "0")
    launcher = DirectLauncher(RecordingJit(), do_not_specialize=("n",))
    x = torch.zeros(8, dtype=torch.int64)
    for _ in range(3):
        launcher((1, 1, 1), (x, 5, 16), {"BLOCK": 4}, num_warps=4)
    assert len(launcher.fn.compiles) == 3 and not launcher.fn.direct
