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


def data_parallel_steps(states, steps: int) -> list[float]:
    """``steps`` optimizer steps of one data-parallel job whose ranks are ``states`` (whole
    replicas, each built with its rank and the job's world size), in this process, as the
    trainer's loop and DDP take them: each rank's micro-steps (loss / grad_accum,
    backward), the gradients averaged over the ranks, then clip, step, schedule. The job's
    mean loss per step."""
    losses = []
    for _ in range(steps):
        total = 0.0
        for state in states:
            for _ in range(state.grad_accum):
                x, y = next(state.loader)
                _, loss = state.model(x, y)
                (loss / state.grad_accum).backward()
                total += loss.item() / state.grad_accum / len(states)
        for grads in zip(*[[p.grad for p in s.model.parameters()] for s in states]):
            mean = torch.stack(grads).mean(0)
            for grad in grads:
                grad.copy_(mean)
        for state in states:
            torch.nn.utils.clip_grad_norm_(state.model.parameters(), 1.0)
            state.optimizer.step()
            state.scheduler.step()
            state.optimizer.zero_grad(set_to_none=True)
            state.step += 1
        losses.append(total)
    return losses
