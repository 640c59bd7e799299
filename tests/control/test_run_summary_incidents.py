"""The end summary of `trainwatch run`: its incidents row."""

from trainwatch.control.run_summary import incidents_text


def test_identical_incident_causes_are_counted_not_merged_away():
    """Three restarts, two for the same cause: the summary said "3: A; B", as if one of
    the three had no cause; now every incident is accounted for."""
    causes = ["rank 1 killed by SIGKILL", "node n1 lost", "rank 1 killed by SIGKILL"]
    assert incidents_text(causes) == "3: rank 1 killed by SIGKILL (2 times); node n1 lost"
    assert incidents_text(["x"]) == "1: x"


def test_the_summary_prints_the_runs_words_as_they_are_not_as_markup(tmp_path):
    """A gloo error in an incident (``RuntimeError: [/__w/pytorch/.../pair.cc:553]
    Connection closed by peer``) read as rich markup: a MarkupError traceback and exit 1
    from `trainwatch run` after its job had stopped as asked (node 1 of the lost-node
    e2e). The run's words (paths, causes, problems) are text, printed as they are."""
    import io

    from rich.console import Console

    from trainwatch.control.outcome import STOPPED
    from trainwatch.control.run_summary import Summary, render

    gloo = ("rank 2 exited with code 1: RuntimeError: [/__w/pytorch/pytorch/third_party/"
            "gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.77.0.1]:58275")
    out = io.StringIO()
    summary = Summary(run_dir=tmp_path / "[bold]run", outcome=STOPPED, steps_done=3,
                      incidents=[gloo], problems=["[/x] unreadable"])
    render(summary, Console(file=out, width=400))
    text = out.getvalue()
    assert "pair.cc:553] Connection closed by peer [10.77.0.1]:58275" in text
    assert "[bold]run" in text and "[/x] unreadable" in text
