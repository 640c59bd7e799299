"""The order test files start in on pytest-xdist's workers (`-n 2 --dist loadfile`).

A worker gets a whole file at a time, so the suite ends when the file started last ends:
the longest files must start first and the quick ones fill the last minutes on both
workers. xdist by default reorders files by how many tests they hold, which puts the
one-test end-to-end files (the longest single runs) last and leaves one worker idle while
the other finishes them; the hooks here turn that off and order the files themselves:
the longest by name, then every file with real multi-process runs (marked slow), then the
rest, each group in collection order. tests/conftest.py uses them.
"""

# Longest first (their real runs, measured in CI: an evaluation on a full disk, the
# drills, the shipped deployment's page window, the newcomer's fresh shells).
LONGEST_FILES = ("test_run_never_harm_e2e.py", "test_drill.py", "test_deploy_shipped_e2e.py",
                 "test_false_pages_e2e.py", "test_multinode_netns.py",
                 "test_newcomer_readme.py")


def keep_our_file_order(config) -> None:
    """Stop xdist from reordering files by their number of tests (`--loadscope-reorder`)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def longest_files_first(items) -> None:
    """Sort ``items`` in place: the longest files, the slow ones, the rest (stable)."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}

    def rank(item) -> tuple[int, int]:
        name = item.path.name
        if name in LONGEST_FILES:
            return 0, LONGEST_FILES.index(name)
        return (1 if item.path in slow else 2), 0
    items.sort(key=rank)
