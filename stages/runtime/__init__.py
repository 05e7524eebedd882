"""The engine the stages share: torchrun launching and process trees, model types and weight
loading, batching and the token loss, checkpoints, generation, and the SFT worker loop.
Stages import it; it never imports a stage."""
