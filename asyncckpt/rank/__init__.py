"""The rank side: what runs in a training process (client, staging into the ring, the
flattening of a state dict, save handles, cross-node agreement, starting a writer)."""
