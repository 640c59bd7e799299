"""The contract every component reads and none owns (torch-free): metric names and labels,
the run-directory layout, phases, rank states and the alert vocabulary."""
