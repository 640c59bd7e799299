"""Whether anything will restart the run: the supervisor its lock file names, alive or
not, and whether this node rebooted since its ranks ran here (their boot id is not
this boot's). A run none supervises whose ranks are all gone is abandoned: it pages
until someone closes it (``trainwatch close``) or starts it again."""

from __future__ import annotations

from trainwatch.diagnose.model import Evidence
from trainwatch.diagnose.processes import local_names
from trainwatch.node import boot_id
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.runlock import recorded_holder


def gather(run: RunDir, ev: Evidence) -> None:
    holder = recorded_holder(run)
    if holder is None:
        held = False
    elif holder.here():
        held = holder.alive()
    else:
        held = None  # another host's process: cannot be checked from here
    here = local_names()
    ev.supervisor = {
        "held": held, "holder": holder.describe() if holder else None,
        "rebooted_ranks": sorted(r for r, v in ev.ranks.items()
                                 if v.get("node") in here and v.get("boot")
                                 and v.get("boot") != boot_id())}
