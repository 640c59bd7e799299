"""diagnose's rules, one module each, and the order they run in.

Each rule is a ``check_*`` function over the shared case file
(``trainwatch.diagnose.casefile.Analysis``) that returns its ``Finding``s. ``RULES`` lists
them by strength: a rule that explains a rank adds it to ``Analysis.explained``, and the
weaker rules after it do not blame that rank again (a dead rank is not also a stall).
"""

from __future__ import annotations

from collections.abc import Callable

from trainwatch.diagnose.casefile import Analysis
from trainwatch.diagnose.model import Finding
from trainwatch.diagnose.rules import (blocked_in_kernel, busy, cpu_contention, crossed, dead,
                                       desync,
                                       first_silent, frozen, node_evidence, nodes, nonfinite,
                                       outside_collective, silent_corruption, slow_link,
                                       storage_and_checkpoints, straggler, unexplained_stall)

Rule = Callable[[Analysis], list[Finding]]

# Strongest first: the order decides which rule explains a rank.
RULES: tuple[Rule, ...] = (
    first_silent.check_first_silent,  # across nodes: the culprit, before its victims' deaths
    dead.check_dead,
    frozen.check_frozen,
    nodes.check_nodes,
    desync.check_desync,
    crossed.check_crossed,
    busy.check_busy,
    outside_collective.check_outside_collective,
    blocked_in_kernel.check_blocked_in_kernel,
    unexplained_stall.check_unexplained_stall,
    storage_and_checkpoints.check_storage_and_checkpoints,
    nonfinite.check_nonfinite,
    silent_corruption.check_silent_corruption,
    slow_link.check_slow_link,  # ranks slowed by a link are not stragglers
    cpu_contention.check_cpu_contention,  # a whole slowed node is not one straggler
    straggler.check_straggler,
    node_evidence.check_node_evidence,
)
