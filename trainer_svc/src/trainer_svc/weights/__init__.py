"""The weights side: publishing the weights the workers load (whole directories, sparse deltas,
shared-memory slots; sync chooses), resume checkpoints, and importing a GGUF model."""
