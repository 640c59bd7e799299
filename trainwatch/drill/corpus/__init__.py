"""The diagnosis corpus: labelled fault injections, one file per kind in ``cases/``, run under
``trainwatch run`` and scored against what ``trainwatch diagnose`` says (docs/drill.md)."""
