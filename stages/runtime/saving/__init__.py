"""What a rank saves and when: checkpoint (DCP checkpoints, their allow-listed metadata reader, RNG
state, the weights evaluation loads), checkpoint_schedule (when to save, what to resume, the best
check kept), hf_export (the Hugging Face folder train ships) and faults (the SFTFLOW_FAULT test hook
around checkpoint saves). Part of the runtime: the loop (worker.py) imports it; evaluate's runner and the
pipeline's checkpoint check read checkpoints through it."""
