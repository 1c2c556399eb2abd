"""Flow test fixtures: our Flow and the reference flow sharing random weights and one noise buffer."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from gpu_worker.model.config import FlowArgs, ModelArgs
from gpu_worker.model.flow import Flow
from tests.gpu_worker.model.ref_oracle import (
    random_state_dict,
    reference_flow,
    reference_on_meta,
    seeded_noise,
)


@dataclass
class FlowPair:
    args: FlowArgs
    ref: torch.nn.Module  # stepaudio2 CausalMaskedDiffWithXvec on the CPU, eval mode
    ours: Flow
    noise: torch.Tensor  # [1, 80, 30000], also the reference's noise buffer


def build_pair(preset: str, cache_frames: int) -> FlowPair:
    pytest.importorskip("stepaudio2.cosyvoice2.flow.flow")
    args = ModelArgs.preset(preset).flow
    weights = random_state_dict(reference_on_meta(args), seed=0)
    noise = seeded_noise(args, seed=1)
    ref = reference_flow(args, weights, noise, cache_frames=cache_frames)
    with torch.device("meta"):
        ours = Flow(args)
    ours.load_state_dict(weights, strict=True, assign=True)
    return FlowPair(args, ref, ours.eval(), noise)


@pytest.fixture(scope="session")
def tiny_pair() -> FlowPair:
    return build_pair("tiny", cache_frames=600)


@pytest.fixture(scope="session")
def full_pair() -> FlowPair:
    return build_pair("full", cache_frames=64)


@pytest.fixture(scope="session")
def tiny_flow() -> Flow:
    """Our tiny Flow alone, with the pair's random weights (no reference needed)."""
    args = ModelArgs.tiny().flow
    with torch.device("meta"):
        flow = Flow(args)
    flow.load_state_dict(random_state_dict(flow, seed=0), strict=True, assign=True)
    return flow.eval()


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Runs a module's tests on one intra-op thread: on a shared 2-core box the tiny preset's small
    matmuls spend far longer in OpenMP hand-offs than in arithmetic (measured 70x)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
