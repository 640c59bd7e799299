"""Rank 1 skips one all_reduce on a side group inside a user phase ("metrics")."""

from trainwatch.drill.corpus.case import Case, Context, Expect


def side_all_reduce(ctx: Context) -> None:
    import torch
    import torch.distributed as dist
    if not (ctx.faulty and ctx.step == ctx.fault_step):
        dist.all_reduce(torch.ones(1), group=ctx.side_group)  # the bug: one rank skips it


CASE = Case(
    kind="desync_side_group",
    simulates="a desync: one rank skips a metrics all_reduce on a side group (a data-"
              "dependent branch), the others wait in it forever",
    expect=Expect(category=("collective_desync", "rank_stuck"), ranks=(1,),
                  cause=("collective",)),
    every_step=side_all_reduce, phase="metrics", nproc=3)
