"""Submodule: a declared child reads from nn.Module's registry, so registration, state_dict
keys and replacement behave as without the declaration."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from srt.utils.submodule import Submodule


class Plain(nn.Module):
    def __init__(self, with_norm: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 5)
        if with_norm:
            self.norm = nn.LayerNorm(5)


class Declared(Plain):
    proj: Submodule[nn.Linear] = Submodule()
    norm: Submodule[nn.LayerNorm] = Submodule()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


def test_same_registry_and_state_dict_as_undeclared():
    torch.manual_seed(0)
    plain = Plain()
    torch.manual_seed(0)
    declared = Declared()
    assert list(declared.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in declared.named_modules()] == [n for n, _ in plain.named_modules()]
    assert declared.proj is declared._modules["proj"] and "proj" not in vars(declared)
    declared.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3)
    assert torch.equal(declared(x), plain.norm(plain.proj(x)))
    assert isinstance(Declared.proj, Submodule) and Declared.proj.name == "proj"


def test_replacement_none_and_missing():
    m = Declared()
    new = nn.Linear(3, 5, bias=False)
    m.proj = new  # nn.Module's registration: the read sees the new child
    assert m.proj is new and m._modules["proj"] is new and "proj.bias" not in m.state_dict()
    m.proj = None
    assert m.proj is None and "proj" in m._modules
    bare = Declared(with_norm=False)
    assert not hasattr(bare, "norm")
    with pytest.raises(AttributeError, match="'Declared' object has no attribute 'norm'"):
        bare.norm  # noqa: B018
    bare.norm = None  # a first None: registered like nn.Module does
    assert bare.norm is None and list(bare._modules) == ["proj", "norm"]
    with pytest.raises(TypeError):
        bare.norm = 3  # type: ignore[assignment]
    del m.norm
    assert not hasattr(m, "norm")


def test_copies_and_moves():
    m = Declared()
    c = copy.deepcopy(m)
    assert c.proj is not m.proj and torch.equal(c.proj.weight, m.proj.weight)
    m.to(torch.float64)
    assert m.proj.weight.dtype == torch.float64
