"""The prepare stage: `stage.py` (sources -> Arrow shards), `rows.py` (the per-row work, in this
process or spawned workers), `masking.py` and `shapes.py` (rendering and assistant masks).
Kept empty so that a spawned worker, which imports `rows`, does not import the stage."""
