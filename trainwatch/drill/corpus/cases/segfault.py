"""Rank 1 dereferences a null pointer in C."""

from trainwatch.drill.corpus.case import Case, Context, Expect


def null_pointer(ctx: Context) -> None:
    import ctypes
    ctypes.string_at(0)  # SIGSEGV, as a buggy C extension or driver would


CASE = Case(
    kind="segfault",
    simulates="a rank crashes with a segmentation fault (a buggy C/C++ extension, a driver)",
    expect=Expect(category=("rank_dead",), ranks=(1,), cause=("SIGSEGV",)),
    fault=null_pointer, ends_job=True)
