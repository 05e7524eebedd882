"""MLflow: the run and its lineage (run), the one metrics sender (live), a new SQLite store (sqlite_store),
the registry's look-ups and the promotion lock (registry), a sweep's parent run (sweep), the UI's links
(ui) and a drop the data gate stopped (gate). Stages, models, runtime, pipeline and retention import it;
it imports only stages.core."""
