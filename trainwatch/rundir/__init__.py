"""The run directory and the files a run leaves in it (docs/run-directory.md).

``run_dir`` (``RunDir``: typed reading and writing of one run), ``atomic`` (atomic files,
whole-line appends), ``safe_read`` (the one safe reader), ``jsonl`` (journal and metrics
logs), ``beat`` (a rank's fixed-size liveness record), ``attempts`` (generations of rank
processes, from the journal), ``runlock`` (one supervisor per run directory),
``torchrun_log`` (what torchrun's log says of its failed workers).
"""
