"""The end summary of `trainwatch run`: its incidents row."""

from trainwatch.control.run_summary import incidents_text


def test_identical_incident_causes_are_counted_not_merged_away():
    """Three restarts, two for the same cause: the summary said "3: A; B", as if one of
    the three had no cause; now every incident is accounted for."""
    causes = ["rank 1 killed by SIGKILL", "node n1 lost", "rank 1 killed by SIGKILL"]
    assert incidents_text(causes) == "3: rank 1 killed by SIGKILL (2 times); node n1 lost"
    assert incidents_text(["x"]) == "1: x"
