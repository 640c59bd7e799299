"""Shared by the reference trainer's tests: training steps run in this process."""

import torch


def run_steps(state, steps: int) -> list[float]:
    """``steps`` optimizer steps of a built training state, as the trainer's loop takes
    them (clip, step, schedule); the losses."""
    losses = []
    for _ in range(steps):
        x, y = next(state.loader)
        _, loss = state.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(state.model.parameters(), 1.0)
        state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        losses.append(loss.item())
    return losses
