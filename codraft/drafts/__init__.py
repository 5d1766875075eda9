"""Draft models on one base (base.py); each family module registers itself for export/load (export.py)."""

from codraft.drafts import dflash, dspark, eagle3  # noqa: F401  (each registers its family)
