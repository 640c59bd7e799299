"""Rank 1 waits on a socket nobody answers."""

from trainwatch.drill.corpus.case import Case, Context, Expect


def wait_for_reply(ctx: Context) -> None:
    import socket
    client, server = socket.socketpair()  # the server side never answers
    client.recv(1)


CASE = Case(
    kind="socket_recv",
    simulates="a rank waits on a socket for a reply that never comes (a metrics or "
              "parameter server that hangs)",
    expect=Expect(category=("rank_stuck",), ranks=(1,), cause=("socket",)),
    fault=wait_for_reply, phase="metrics")
