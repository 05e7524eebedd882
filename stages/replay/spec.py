"""What the replay processes are given (`spec.json`); its own module so the workers and the
stage import it without importing each other."""

from pydantic import BaseModel, ConfigDict

from stages.core.config import SFTConfig


class ReplaySpec(BaseModel):
    """What the generating processes are given (`spec.json`)."""

    model_config = ConfigDict(extra="forbid")

    config: SFTConfig
    model_path: str
    prompts: list[dict]   # {"source": file:line, "prompt": [messages]}
    out_dir: str
