"""The Code2Wav model: `Flow` (tokens -> mel) and `HiFTGenerator` (mel -> audio), pure nn.Modules.

`Code2Wav` only holds the two and their hyper-parameters; loading lives in `gpu_worker.checkpoint.load`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn

from gpu_worker.model.config import ModelArgs

if TYPE_CHECKING:
    from gpu_worker.model.flow import Flow
    from gpu_worker.model.hift import HiFTGenerator


class Code2Wav(nn.Module):
    """Container: `.flow`, `.hift`, `.args`. Its state dict is the two components' under `flow.` / `hift.`."""

    flow: Flow
    hift: HiFTGenerator

    def __init__(self, flow: Flow, hift: HiFTGenerator, args: ModelArgs):
        super().__init__()
        self.flow = flow
        self.hift = hift
        self.args = args
