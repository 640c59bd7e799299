"""Rank 1 issues a barrier the others never issue."""

from trainwatch.drill.corpus.case import Case, Context, Expect


def extra_barrier(ctx: Context) -> None:
    import torch.distributed as dist
    dist.barrier()  # the bug: a collective only this rank issues


CASE = Case(
    kind="extra_collective",
    simulates="a desync: one rank issues a collective the others do not (a barrier in a "
              "rank-0-only branch gone wrong)",
    expect=Expect(category=("collective_desync",), ranks=(1,), cause=("collective",)),
    fault=extra_barrier, phase="allreduce")
