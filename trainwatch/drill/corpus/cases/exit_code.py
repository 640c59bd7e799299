"""Rank 1 exits with code 3 without a word."""

from trainwatch.drill.corpus.case import Case, Context, Expect

CODE = 3  # what the job exits with: not one of trainwatch's own exit codes


def exit_3(ctx: Context) -> None:
    import os
    os._exit(CODE)  # a library calling exit() deep inside


CASE = Case(
    kind="exit_code",
    simulates="a rank exits with an error code and no traceback (a library's exit(), a "
              "failed assertion in C)",
    expect=Expect(category=("rank_dead",), ranks=(1,), cause=("exit code 3",)),
    fault=exit_3, ends_job=True)
