"""The orchestration over the stages (docs/architecture.md), in three rooms: the Prefect flows at this
level (sft.py: `sft_pipeline` / `sft_stage`, a thin task per stage; sweep.py; serve.py and deploy.py,
the deployments; events.py, data arrivals), the CLI (flows/cli/) and the servers and the team's setup
(flows/servers/). The flows import the servers and stages/; the CLI imports both; the servers import
neither. Never imports torch when imported (tests/test_architecture.py)."""
