"""One module per corpus kind, each defining ``CASE`` (trainwatch/drill/corpus/case.py)."""
