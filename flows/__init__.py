"""The Prefect flows and the CLI over the stages (docs/architecture.md)."""
