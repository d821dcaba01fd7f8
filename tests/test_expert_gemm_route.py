"""The routed-experts kernel route (kvforge/models/expert_gemm_route.py): which steps the Triton expert
kernel takes, and its switch. Tensors on the meta device carry shapes, dtypes and strides only; the route
is told the meta device is a kernel device, so the rule is checked without running anything."""

from __future__ import annotations

import pytest
import torch

from kvforge.env import read_env
from kvforge.models import expert_gemm_route
from kvforge.models.expert_gemm_route import TRITON_EXPERT_GEMM_MAX_ROWS_PER_EXPERT, use_triton_expert_gemm

EXPERTS, N, K = 64, 2816, 2048


@pytest.fixture
def route_on(monkeypatch):
    monkeypatch.setattr(expert_gemm_route, "TRITON_EXPERT_GEMM", True)
    monkeypatch.setattr(expert_gemm_route, "TRITON_EXPERT_GEMM_DEVICES", ("meta",))


def tensors(dtype=torch.bfloat16, tokens=8):
    a = torch.empty(tokens, K, dtype=dtype, device="meta")
    w = torch.empty(EXPERTS, N, K, dtype=dtype, device="meta")
    return a, w


def test_decode_sized_steps_take_the_kernel(route_on):
    a, w = tensors()
    with torch.no_grad():
        assert use_triton_expert_gemm(1, a, w)
        most = TRITON_EXPERT_GEMM_MAX_ROWS_PER_EXPERT * EXPERTS
        assert use_triton_expert_gemm(most, a, w)
        assert use_triton_expert_gemm(128 * 6, a, w)  # 128 tokens at DeepSeek-V2-Lite's top-6
        assert not use_triton_expert_gemm(most + 1, a, w)  # prefill-sized: grouped_mm
        assert not use_triton_expert_gemm(256 * 6, a, w)  # measured slower than grouped_mm there
        w256 = torch.empty(256, N, K, dtype=torch.bfloat16, device="meta")  # rows per expert, not per step
        assert use_triton_expert_gemm(256 * 8, a, w256)
        assert not use_triton_expert_gemm(0, a, w)


def test_other_dtypes_layouts_and_autograd_keep_grouped_mm(route_on):
    a, w = tensors(torch.float32)
    with torch.no_grad():
        assert not use_triton_expert_gemm(8, a, w)
        a, w = tensors()
        assert not use_triton_expert_gemm(8, a, w.transpose(1, 2))  # K not contiguous
        assert not use_triton_expert_gemm(8, a.half(), w)  # mixed dtypes
    assert not use_triton_expert_gemm(8, a, w)  # grad mode on: the kernel is inference-only


def test_cuda_only_by_default():
    a, w = tensors()
    with torch.no_grad():
        assert expert_gemm_route.TRITON_EXPERT_GEMM_DEVICES == ("cuda",)
        assert not use_triton_expert_gemm(8, a, w)  # meta is not a kernel device


def test_switch(monkeypatch, route_on):
    a, w = tensors()
    monkeypatch.setattr(expert_gemm_route, "TRITON_EXPERT_GEMM", False)
    with torch.no_grad():
        assert not use_triton_expert_gemm(8, a, w)
    assert read_env({}).triton_expert_gemm is None  # unset: the route's default (on)
    assert expert_gemm_route.TRITON_EXPERT_GEMM_DEFAULT is True
    assert read_env({"KVFORGE_TRITON_EXPERT_GEMM": "0"}).triton_expert_gemm is False
    assert read_env({"KVFORGE_TRITON_EXPERT_GEMM": "1"}).triton_expert_gemm is True
