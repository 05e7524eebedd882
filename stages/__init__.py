"""Everything that computes: the stages, the packages they share, and the stage table that plans and
runs them (docs/architecture.md, "The floor plan"). Never imports prefect; flows/ orchestrates it."""
