"""The weights side: publishing the weights the workers load (whole directories, sparse deltas,
shared-memory slots, LoRA adapters; sync chooses), resume checkpoints, importing a GGUF model, and
merging an adapter into a full model for export."""
