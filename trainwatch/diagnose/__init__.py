"""``trainwatch diagnose``: gather evidence about a run, analyse it, name the culprit.

Gathering (one module per source: run_state, processes, rank_dumps, stacks,
flight_recorder, agents, prometheus, journal, checkpoints) fills an ``Evidence``;
analysis (collectives, then the rules in ``rules/`` over the shared ``casefile``, run by
``analysis``) turns it into ranked ``Finding``s; rendering
(render_human, render_json) and ``bundle`` present them. See docs/diagnose.md.
"""
