"""torch helpers shared by the rank and read sides: dtypes, global tensors (DTensor,
ShardedTensor), which rank this process is. The writer never imports these."""
