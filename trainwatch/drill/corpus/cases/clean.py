"""No fault: every finding, alert or agent finding during this run is a false one."""

from trainwatch.drill.corpus.case import Case

CASE = Case(kind="clean", simulates="a healthy run (no fault): nothing may be reported",
            expect=None)
