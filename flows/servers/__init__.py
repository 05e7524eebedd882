"""The servers and the team's setup: prefect_server (the Prefect API a CLI call runs on: PREFECT_API_URL,
else a running one on its Prefect home, else a kept one started in the background, else a temporary
one; `serve --start-server`'s server; the keeper, `python -m flows.servers.prefect_server keep`),
prefect_database (a new Prefect home's database, copied from the one the first server of this Prefect
version migrated) and team (a team's PostgreSQL, Prefect and MLflow servers and a pool's workers:
`python -m flows.servers.team up|down|status`, `make team-up`).

Imported by the CLI (flows/cli/) and the flows (flows/sft.py: the temporary server's marker); it
imports no flow and no command, and of stages/ only stages.core (the user's cache folder).
"""
