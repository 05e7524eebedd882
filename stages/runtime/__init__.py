"""The training loop's parts, what runs inside a rank: the SFT worker (`worker.SFTWorker`, the class a
custom `actor.worker` subclasses), model types and weight loading, batching and the mixture, the token
loss, FSDP2 wrapping, DCP checkpoints and when to take them, validation, LoRA, the HF export, and the
rank helpers (`distributed`: logging, device, exact cross-rank sums) that evaluate and replay ranks use
too. Stages import it; it never imports a stage, nor `stages.launch` (a rank starts no processes);
tests/test_architecture.py holds both."""
