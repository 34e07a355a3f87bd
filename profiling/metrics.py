"""Per-step training metrics and per-parameter gradient norms: rung 1's way and rung 4's.

Both loggers record the same numbers for every step: the loss, the direction accuracy per
label horizon (sign of prediction == sign of standardized label) and each parameter's
gradient L2 norm. They differ only in when the host sees them.

HostLogger (rung 1) is how these loops are usually written: `.item()` on the loss, on each
accuracy and on each parameter's norm, every step; each `.item()` waits for the GPU.
DeviceLogger (rung 4) writes the step's values into one on-device ring [interval, columns]
at a device-side slot (so a captured CUDA graph can do it too) and copies the ring to the
host once per logging interval: one sync per interval.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def direction_accuracy(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[L] share of windows whose predicted and actual (standardized) move agree in sign."""
    return ((pred > 0) == (y > 0)).float().mean(0)


class HostLogger:
    def __init__(self, model: nn.Module) -> None:
        self.named = list(model.named_parameters())
        self.loss: list[float] = []
        self.accuracy: list[list[float]] = []
        self.grad_norm: dict[str, list[float]] = {name: [] for name, _ in self.named}

    def record(self, loss: torch.Tensor, pred: torch.Tensor, y: torch.Tensor) -> None:
        self.loss.append(loss.item())
        acc = direction_accuracy(pred.detach(), y)
        self.accuracy.append([acc[h].item() for h in range(acc.shape[0])])
        for name, p in self.named:
            self.grad_norm[name].append(p.grad.norm().item())

    def advance(self) -> None:
        pass

    def end_step(self, step: int, last_step: int) -> None:
        pass

    def series(self) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """loss [steps], accuracy [steps, L], grad_norm {name: [steps]}"""
        return (
            np.asarray(self.loss),
            np.asarray(self.accuracy),
            {k: np.asarray(v) for k, v in self.grad_norm.items()},
        )


class DeviceLogger:
    """Ring columns: loss | accuracy per horizon | gradient norm columns.

    The norm columns are one per parameter (torch._foreach_norm, rung 4) or, with the fused
    optimizer kernel of rung 5, one squared-norm partial per chunk of the flat gradient
    buffer (`chunk_owner[c]` = the parameter of chunk c), summed per parameter on the host.
    """

    def __init__(
        self,
        model: nn.Module,
        n_outputs: int,
        interval: int,
        device: torch.device,
        chunk_owner: np.ndarray | None = None,
    ) -> None:
        self.named = list(model.named_parameters())
        self.params = [p for _, p in self.named]
        self.interval = interval
        self.chunk_owner = chunk_owner
        self.norm_col = 1 + n_outputs
        n_norm = len(self.named) if chunk_owner is None else len(chunk_owner)
        self.ring = torch.zeros(interval, self.norm_col + n_norm, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self._rows: list[np.ndarray] = []

    def record(self, loss: torch.Tensor, pred: torch.Tensor, y: torch.Tensor) -> None:
        values = [loss.detach().reshape(1), direction_accuracy(pred.detach(), y)]
        if self.chunk_owner is None:  # else the fused optimizer writes the norm columns
            values.append(torch.stack(torch._foreach_norm([p.grad for p in self.params])))
        row = torch.cat(values).unsqueeze(0)
        self.ring[:, : row.shape[1]].index_copy_(0, self.slot, row)

    def advance(self) -> None:
        self.slot.add_(1).remainder_(self.interval)

    def end_step(self, step: int, last_step: int) -> None:
        """At the end of each interval (and of the run): the one sync, ring -> host."""
        n = step % self.interval + 1
        if n == self.interval or step == last_step:
            self._rows.append(self.ring[:n].cpu().numpy().copy())  # on a CPU .cpu() is a view

    def series(self) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        rows = np.concatenate(self._rows).astype(np.float64)
        loss, acc = rows[:, 0], rows[:, 1 : self.norm_col]
        norms = rows[:, self.norm_col :]
        if self.chunk_owner is not None:
            starts = np.flatnonzero(np.diff(self.chunk_owner, prepend=-1))
            norms = np.sqrt(np.add.reduceat(norms, starts, axis=1))
        names = [name for name, _ in self.named]
        return loss, acc, {name: norms[:, i] for i, name in enumerate(names)}
